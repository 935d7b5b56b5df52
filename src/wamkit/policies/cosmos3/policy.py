"""`cosmos3`: NVIDIA Cosmos3 as a wamkit policy.

Two independent halves:
- Serving/evaluation (`url=`): `predict` sends the observations to an SGLang action server running Cosmos3
  (`sglang serve --model-type diffusion ...`) through the policy's own `SGLangHttpClient` (or any client passed
  as `client=`, e.g. wamkit.serve's SyncActionClient in SGLang mode: the policies layer does not import the
  serving layer), with our request builder (side-by-side 192x320 image, training-format prompt, LIBERO
  parameters) and our response decoder (wamkit.policies.cosmos3.io). One seed per request in SGLang, so
  observations are grouped by seed (a result depends only on (observation, seed)).
- Training (`framework=True`): the model is built by NVIDIA's cosmos-framework with its own config system
  (`make_config` + `override(experiment=...)` + `instantiate`), its own parallelism turned off (FSDP2 from wamkit's
  trainer is the only sharding), weights warm-started with its own loaders, parameters outside `keys_to_select`
  frozen, 0-d parameters promoted to shape [1] (FSDP2 cannot shard scalars); `sft_loss` runs its `training_step`.
  cosmos-framework cannot be installed on the CPU dev machine: this path raises a UserError naming the module
  there, and is written against the framework API as RLinf's integration uses it (untested here).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, InputSpec, Policy, PolicySpec
from wamkit.policies.cosmos3 import io as C

# Trained by NVIDIA's LIBERO SFT recipe: the generation tower ("moe_gen") plus the adapters around it.
DEFAULT_KEYS_TO_SELECT = ("moe_gen", "time_embedder", "vae2llm", "llm2vae", "action2llm", "llm2action",
                          "action_modality_embed")
# Action in/out layers: 5x learning rate in NVIDIA's recipe.
DEFAULT_LR_MULTIPLIERS = {"*action2llm*": 5.0, "*llm2action*": 5.0}
DEFAULT_EXPERIMENT = "action_policy_libero_nano"
FRAMEWORK_HINT = ("install NVIDIA's cosmos-framework (a GPU machine: `uv sync --all-extras --group=cu130-train` in "
                  "its checkout) or pass framework_module=<its import name>")


def import_framework(framework_module: str = "cosmos_framework"):
    """The cosmos-framework package, or a UserError that names the missing module."""
    try:
        return importlib.import_module(framework_module)
    except ImportError as e:
        raise UserError(f"cosmos3 training/in-process inference needs the Python module {framework_module!r} "
                        f"(NVIDIA cosmos-framework), which is not importable here ({e}); {FRAMEWORK_HINT}. "
                        "Serving through SGLang needs only url=") from None


def _sub(framework_module: str, path: str):
    return importlib.import_module(f"{framework_module}.{path}")


def promote_scalar_params(module) -> list[str]:
    """Replace every 0-d Parameter by a shape-[1] one (same dtype, requires_grad). Returns the names."""
    import torch.nn as nn

    names = [n for n, p in module.named_parameters() if p.ndim == 0]
    for full in names:
        owner_name, _, attr = full.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        old = getattr(owner, attr)
        setattr(owner, attr, nn.Parameter(old.detach().reshape(1), requires_grad=old.requires_grad))
    return names


def freeze_outside(module, keys_to_select: Sequence[str]) -> tuple[int, int]:
    """cosmos's optimizer rule: a parameter trains iff its name contains one of `keys_to_select`.
    Returns (trainable, frozen) element counts."""
    trainable = frozen = 0
    for n, p in module.named_parameters():
        if any(k in n for k in keys_to_select):
            p.requires_grad_(True)
            trainable += p.numel()
        else:
            p.requires_grad_(False)
            frozen += p.numel()
    return trainable, frozen


def build_framework_model(framework_module: str = "cosmos_framework", experiment: str = DEFAULT_EXPERIMENT,
                          model_path: str | None = None, keys_to_select: Sequence[str] = DEFAULT_KEYS_TO_SELECT,
                          keys_to_skip_loading: Sequence[str] = (), ema: bool = False, compile: bool = False,
                          vae_path: str | None = None, build_on_cpu: bool = True):
    """Build Cosmos3 with cosmos-framework's own config system; returns (omni model, its `net`)."""
    import torch

    fw = import_framework(framework_module)
    make_config = _sub(framework_module, "configs.base.config").make_config
    override = _sub(framework_module, "utils.config_helper").override
    instantiate = _sub(framework_module, "utils.lazy_config").instantiate
    Device = _sub(framework_module, "utils.flags").Device
    omni_mod = _sub(framework_module, "model.generator.omni_mot_model")
    root = Path(fw.__file__).resolve().parent.parent      # its configs name files relative to the checkout root

    with contextlib.chdir(root):
        cfg = make_config()
        cfg = override(cfg, ["--", f"experiment={experiment}"])
        par = cfg.model.config.parallelism                 # cosmos's own FSDP / CP / CFG-parallel off
        par.enable_inference_mode = True
        par.data_parallel_shard_degree = 1
        par.context_parallel_shard_degree = 1
        par.cfg_parallel_shard_degree = 1
        cfg.model.config.ema.enabled = bool(ema)
        cfg.model.config.compile.enabled = bool(compile)
        vae = vae_path or os.environ.get("WAN_VAE_PATH")
        if vae:
            cfg.model.config.tokenizer.vae_path = str(vae)
        cfg.validate()
        cfg.freeze()
        target = omni_mod.DEVICE
        if build_on_cpu:                                   # a 16B model + EMA does not fit one GPU before sharding
            omni_mod.DEVICE = Device.CPU
        try:
            model = instantiate(cfg.model)
        finally:
            omni_mod.DEVICE = target
        model.tensor_kwargs = {"device": target, "dtype": model.precision}
        model.tensor_kwargs_fp32 = {"device": target, "dtype": torch.float32}
        for m in model.modules():                          # Qwen3-VL rotary needs fp32 inv_freq
            inv = getattr(m, "inv_freq", None)
            if isinstance(inv, torch.Tensor):
                m.inv_freq = inv.float()
        model.net.init_weights(buffer_device=Device.CPU if build_on_cpu else target)

    if model_path:
        loader = _sub(framework_module, "utils.generator.model_loader")
        if loader._is_safetensors_checkpoint(model_path, None):
            st = _sub(framework_module, "model.generator.utils.safetensors_loader")
            st.load_vfm_model(model.net, model_path, credential_path=None,
                              parallel_dims=getattr(model, "parallel_dims", None),
                              skip_patterns=[f".*{re.escape(s)}.*" for s in keys_to_skip_loading] or None)
        else:
            dcp = os.path.join(model_path, "model") if os.path.isdir(os.path.join(model_path, "model")) \
                else model_path
            loader._load_model(model, dcp, credential_path=None,
                               keys_to_skip_loading=list(keys_to_skip_loading) or None)
    freeze_outside(model.net, keys_to_select)
    ema_net = getattr(model, "net_ema", None)
    if ema_net is not None:                                # the EMA copy never trains
        for p in ema_net.parameters():
            p.requires_grad_(False)
    promote_scalar_params(model)
    return model, model.net


class Cosmos3Policy(Policy):
    """Cosmos3 (LIBERO): `predict` via an SGLang endpoint (`url=`), training via cosmos-framework
    (`framework=True`). See the module docstring."""

    def __init__(self, url: str | None = None, action_stats: Any = None, action_pipeline=None,
                 action_dim: int = 7, horizon: int = C.ACTION_HORIZON, num_inference_steps: int = 30,
                 clip_normalized: bool = False, token: str | None = None, timeout_s: float = 300.0,
                 max_batch: int | None = None, framework: bool = False, framework_module: str = "cosmos_framework",
                 experiment: str = DEFAULT_EXPERIMENT, model_path: str | None = None,
                 keys_to_select: Sequence[str] = DEFAULT_KEYS_TO_SELECT, keys_to_skip_loading: Sequence[str] = (),
                 ema: bool = False, vae_path: str | None = None, device: str = "cpu", client: Any = None, **_):
        if action_dim != 7:
            raise UserError(f"cosmos3 (LIBERO) produces 7-D env actions, got action_dim={action_dim}")
        if horizon != C.ACTION_HORIZON:
            raise UserError(f"cosmos3 (LIBERO) was trained with horizon {C.ACTION_HORIZON}, got {horizon}")
        self.url, self.token, self.timeout_s, self.max_batch = url, token, float(timeout_s), max_batch
        self.num_inference_steps = int(num_inference_steps)
        self.clip_normalized = bool(clip_normalized)
        self.action_stats = action_stats
        if action_pipeline is not None:
            from wamkit.policies.wam_ref.policy import as_action_pipeline

            self.action_pipeline = as_action_pipeline(action_pipeline)
        else:
            self.action_pipeline = C.cosmos3_action_pipeline(action_stats, clip=self.clip_normalized)
        self.framework_module, self.experiment = framework_module, experiment
        self.keys_to_select = tuple(keys_to_select)
        self.trainable_patterns = tuple(f"*{k}*" for k in self.keys_to_select)
        self.device = device
        self._client = client   # injected: any object with predict(observations, seeds) and close()
        self._omni = None
        self._global_step = 0
        if framework:
            self._omni, _ = build_framework_model(framework_module, experiment, model_path, self.keys_to_select,
                                                  keys_to_skip_loading, ema=ema, vae_path=vae_path)
        self.spec = PolicySpec(
            name="cosmos3",
            input=InputSpec(cameras=C.COSMOS3_CAMERAS, image_size=C.CAMERA_SIZE[0], state_dim=0, text=True),
            action=ActionSpec(dim=7, horizon=C.ACTION_HORIZON, representation="rot6d10"),
            deterministic=True, trainable=framework,
            extra={"domain": C.LIBERO_DOMAIN, "domain_id": C.LIBERO_DOMAIN_ID, "raw_action_dim": C.RAW_ACTION_DIM,
                   "num_inference_steps": self.num_inference_steps, "url": url})

    # ------------------------------------------------------------------ serving (SGLang)
    def sglang_parameters(self) -> dict[str, Any]:
        return C.cosmos3_parameters(self.num_inference_steps)

    def _sync_client(self):
        if self.url is None:
            raise UserError("cosmos3 predict needs url= (an SGLang action server running Cosmos3); in-process "
                            "Cosmos3 inference is cosmos-framework's and not wrapped here")
        if self._client is None:
            self._client = SGLangHttpClient(self.url, self.token, self.timeout_s, self.sglang_parameters(),
                                            max_batch=self.max_batch_size())
        return self._client

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        if len(observations) != len(seeds):
            raise UserError(f"predict got {len(observations)} observations and {len(seeds)} seeds")
        if len(observations) == 0:
            return np.zeros((0, C.ACTION_HORIZON, 7), np.float32)
        if not any(type(s).__name__ == "QuantileNormalizeStep" for s in self.action_pipeline.steps):
            raise UserError("cosmos3 returns normalized actions in policy mode: pass action_stats= (q01/q99 of "
                            "the 10-D training actions, or the stats JSON) so they can be denormalized")
        sent = [C.cosmos3_observation(o) for o in observations]
        normalized = self._sync_client().predict(sent, [int(s) for s in seeds])
        return C.decode_cosmos3_actions(normalized, self.action_pipeline)

    def max_batch_size(self) -> int:
        return int(self.max_batch or 64)

    def close(self) -> None:
        if self._client is not None and hasattr(self._client, "close"):
            self._client.close()
        self._client = None

    # ------------------------------------------------------------------ training (cosmos-framework)
    def _need_framework(self):
        if self._omni is None:
            import_framework(self.framework_module)  # raises the UserError naming the module when missing
            raise UserError("this cosmos3 policy was built without the framework: pass framework=True")
        return self._omni

    @property
    def module(self):
        return self._need_framework()

    def fsdp_units(self) -> list:
        """cosmos's decoder layers (both towers of the MoT), then the root."""
        omni = self._need_framework()
        units = [m for m in omni.net.modules() if type(m).__name__ in ("MoTDecoderLayer",)]
        return [*units, omni]

    def lr_multipliers(self) -> dict[str, float]:
        return dict(DEFAULT_LR_MULTIPLIERS)

    def set_global_step(self, step: int) -> None:
        self._global_step = int(step)

    def sft_loss(self, batch: dict[str, Any]):
        """cosmos's own training step on a cosmos-format batch (`batch["cosmos"]`, as its LIBERO dataloader
        produces it). Returns (loss, scalar metrics from its output batch)."""
        import torch

        omni = self._need_framework()
        data = batch.get("cosmos") if isinstance(batch, dict) else None
        if data is None:
            raise UserError("cosmos3 sft_loss needs the batch in cosmos-framework's format under batch['cosmos'] "
                            "(its LIBERO dataloader's output); wamkit-format batches are not converted")
        to = _sub(self.framework_module, "utils.misc").to
        data = to(data, omni.tensor_kwargs["device"])
        output, loss = omni.training_step(data, self._global_step)
        metrics = {"loss": float(loss.detach())}
        if isinstance(output, dict):
            for k, v in output.items():
                if k != "loss" and torch.is_tensor(v) and v.numel() == 1:
                    metrics[k] = float(v.detach())
        return loss, metrics

    def export_config(self) -> dict[str, Any]:
        return {"url": self.url, "num_inference_steps": self.num_inference_steps,
                "clip_normalized": self.clip_normalized, "framework_module": self.framework_module,
                "experiment": self.experiment, "keys_to_select": list(self.keys_to_select)}


class SGLangHttpClient:
    """The policy's own client for the SGLang action contract (`POST /v1/actions/generations`, JSON): one request per
    (prompt, seed) group of at most `max_batch` observations, since SGLang batches one prompt and one seed per
    request. 503 (busy) and connection errors are retried `retries` times (Retry-After, else exponential backoff);
    other errors raise a UserError with the server's message. wamkit.serve's ActionClient is richer (async,
    msgpack, worker restarts); pass it as `Cosmos3Policy(client=...)` where the serving layer is at hand."""

    def __init__(self, url: str, token: str | None, timeout_s: float, parameters: dict[str, Any],
                 max_batch: int = 64, retries: int = 3, backoff_s: float = 0.5):
        import httpx

        self.parameters = dict(parameters)
        self.max_batch, self.retries, self.backoff_s = max(1, int(max_batch)), int(retries), float(backoff_s)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers)

    def _post(self, body: dict[str, Any]):
        import httpx

        for attempt in range(self.retries + 1):
            try:
                r = self._http.post("/v1/actions/generations", json=body)
            except httpx.TransportError as e:
                if attempt == self.retries:
                    raise UserError(f"SGLang {self._http.base_url} unreachable: {type(e).__name__}: {e}") from None
            else:
                if r.status_code != 503 or attempt == self.retries:
                    return r
                after = r.headers.get("retry-after")
                if after and after.replace(".", "", 1).isdigit():
                    time.sleep(float(after))
                    continue
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        from wamkit.protocol.sglang import build_sglang_request, decode_sglang_response

        out: np.ndarray | None = None
        groups: dict[tuple, list[int]] = {}
        for i, (o, s) in enumerate(zip(observations, seeds)):
            groups.setdefault((o.task, int(s)), []).append(i)
        chunks = [(seed, idx[k:k + self.max_batch]) for (_, seed), idx in groups.items()
                  for k in range(0, len(idx), self.max_batch)]
        for seed, idx in chunks:
            body = build_sglang_request([observations[i] for i in idx], seed, self.parameters,
                                        camera="image", binary=False)
            r = self._post(body)
            if r.status_code >= 400:
                raise UserError(f"SGLang {r.request.url} -> {r.status_code}: {r.text[:300]}")
            acts = decode_sglang_response(r.json(), C.RAW_ACTION_DIM, expect_n=len(idx))
            if out is None:
                out = np.empty((len(observations),) + acts.shape[1:], np.float32)
            out[idx] = acts
        return out

    def close(self) -> None:
        self._http.close()
