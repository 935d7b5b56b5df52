"""`cosmos3`: NVIDIA Cosmos3 as a wamkit policy.

Two independent halves:
- Serving/evaluation: the model runs in an SGLang action server (`sglang serve --model-type diffusion ...`). The
  policy's RemoteCodec (`remote_codec()`) holds what runs in the evaluation process: the request builder (side-by-side
  192x320 image, prompt and framing, LIBERO parameters, the request seed) and the response decoder (quantile
  denormalization unless the server does it, rot6d -> axis-angle, gripper); wamkit.protocol.client carries the
  requests (one transport for the adapter and for `wamkit eval`: SGLang's metadata read, its batch limit and rules
  checked before sending). `wamkit eval ... inference=server` sends several requests at once over N servers;
  `predict()` (with `url=`) is the same path, blocking, for scripts.
- Training (`framework=True`): the model is built by NVIDIA's cosmos-framework with its own config system
  (`make_config` + `override(experiment=...)` + `instantiate`), its own parallelism turned off (FSDP2 from wamkit's
  trainer is the only sharding), weights warm-started with its own loaders, parameters outside `keys_to_select`
  frozen, 0-d parameters promoted to shape [1] (FSDP2 cannot shard scalars); `sft_loss` runs its `training_step`.
  cosmos-framework cannot be installed on the CPU dev machine: this path raises a UserError naming the module
  there, and is written against the framework API as RLinf's integration uses it (untested here).

Normalization: SGLang returns normalized actions unless it was started with action stats (then it denormalizes
itself, and the response does not say so). `normalization="client"` (default) needs `action_stats` and
denormalizes here; `normalization="server"` takes none. Passing stats with "server" is refused (they would be applied
twice), and so is starting an SGLang server with stats for a "client" policy (wamkit.eval.inference).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, InputSpec, Policy, PolicySpec, RemoteCodec
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


NORMALIZATIONS = ("client", "server")
DEFAULT_REQUEST_SEED = 1140          # one seed for every request, as RLinf's evaluation sends (full batches)


class Cosmos3Codec(RemoteCodec):
    """Cosmos3 LIBERO on SGLang: what runs in the evaluation process around the transport."""

    protocol, camera, raw_action_dim = "sglang", "image", C.RAW_ACTION_DIM

    def __init__(self, num_inference_steps: int, framing: str, seed: int | None, pipeline,
                 server_normalizes: bool = False):
        self.num_inference_steps, self.framing, self.seed = int(num_inference_steps), framing, seed
        self.pipeline, self.server_normalizes = pipeline, bool(server_normalizes)

    def parameters(self) -> dict[str, Any]:
        return C.cosmos3_parameters(self.num_inference_steps, framing=self.framing)

    def encode(self, observations: Sequence[Observation]) -> list[Observation]:
        return [C.cosmos3_observation(o, framing=self.framing) for o in observations]

    def seeds(self, seeds: Sequence[int]) -> list[int]:
        return [int(s) for s in seeds] if self.seed is None else [int(self.seed)] * len(seeds)

    def decode(self, values: np.ndarray) -> np.ndarray:
        return C.decode_cosmos3_actions(values, self.pipeline)


class Cosmos3Policy(Policy):
    """Cosmos3 (LIBERO): served by SGLang (`url=` for predict(); `wamkit eval inference=server` reaches it through
    remote_codec()), training via cosmos-framework (`framework=True`). See the module docstring.

    Serving options: `framing` recipe|rlinf (see wamkit.policies.cosmos3.io), `seed` the one seed of every request
    (None: each observation's own seed from the scheduler, exact but batches only share a seed by chance),
    `normalization` client|server, `action_stats` (q01/q99 of the 10-D training actions, a dict or a stats JSON),
    `max_batch` (None: the server's metadata)."""

    def __init__(self, url: str | None = None, action_stats: Any = None, action_pipeline=None,
                 action_dim: int = 7, horizon: int = C.ACTION_HORIZON, num_inference_steps: int = 30,
                 clip_normalized: bool = False, token: str | None = None, timeout_s: float = 300.0,
                 max_batch: int | None = None, framing: str = C.DEFAULT_FRAMING,
                 seed: int | None = DEFAULT_REQUEST_SEED, normalization: str = "client", framework: bool = False,
                 framework_module: str = "cosmos_framework",
                 experiment: str = DEFAULT_EXPERIMENT, model_path: str | None = None,
                 keys_to_select: Sequence[str] = DEFAULT_KEYS_TO_SELECT, keys_to_skip_loading: Sequence[str] = (),
                 ema: bool = False, vae_path: str | None = None, device: str = "cpu", client: Any = None):
        if action_dim != 7:
            raise UserError(f"cosmos3 (LIBERO) produces 7-D env actions, got action_dim={action_dim}")
        if horizon != C.ACTION_HORIZON:
            raise UserError(f"cosmos3 (LIBERO) was trained with horizon {C.ACTION_HORIZON}, got {horizon}")
        if normalization not in NORMALIZATIONS:
            raise UserError(f"cosmos3 normalization={normalization!r}: valid choices are {', '.join(NORMALIZATIONS)}")
        if normalization == "server" and (action_stats is not None or action_pipeline is not None):
            raise UserError("cosmos3 normalization=server means the SGLang server denormalizes (it was started with "
                            "action stats): drop action_stats here, or they would be applied twice")
        if seed is not None and (isinstance(seed, bool) or int(seed) < 0):
            raise UserError(f"cosmos3 seed must be a non-negative integer or null, got {seed!r}")
        self.url, self.token, self.timeout_s, self.max_batch = url, token, float(timeout_s), max_batch
        self.num_inference_steps = int(num_inference_steps)
        self.clip_normalized = bool(clip_normalized)
        self.framing = C.check_framing(framing)
        self.seed = None if seed is None else int(seed)
        self.normalization = normalization
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
                   "num_inference_steps": self.num_inference_steps, "url": url, "framing": self.framing,
                   "seed": self.seed, "normalization": self.normalization})

    # ------------------------------------------------------------------ serving (SGLang)
    def remote_codec(self) -> Cosmos3Codec:
        has_quantile = any(type(s).__name__ == "QuantileNormalizeStep" for s in self.action_pipeline.steps)
        if self.normalization == "client" and not has_quantile:
            raise UserError("cosmos3 returns normalized actions in policy mode: pass action_stats= (q01/q99 of the "
                            "10-D training actions, or the stats JSON) so they can be denormalized, or "
                            "normalization=server if the SGLang server was started with action stats")
        return Cosmos3Codec(self.num_inference_steps, self.framing, self.seed, self.action_pipeline,
                            server_normalizes=self.normalization == "server")

    def sglang_parameters(self) -> dict[str, Any]:
        return C.cosmos3_parameters(self.num_inference_steps, framing=self.framing)

    def _sync_client(self):
        if self.url is None:
            raise UserError("cosmos3 predict needs url= (an SGLang action server running Cosmos3); in-process "
                            "Cosmos3 inference is cosmos-framework's and not wrapped here")
        if self._client is None:
            from wamkit.protocol.client import SyncActionClient

            self._client = SyncActionClient(self.url, token=self.token, timeout_s=self.timeout_s, mode="sglang",
                                            camera="image", parameters=self.sglang_parameters(),
                                            raw_action_dim=C.RAW_ACTION_DIM, max_batch=self.max_batch)
        return self._client

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        if len(observations) != len(seeds):
            raise UserError(f"predict got {len(observations)} observations and {len(seeds)} seeds")
        if len(observations) == 0:
            return np.zeros((0, C.ACTION_HORIZON, 7), np.float32)
        codec = self.remote_codec()
        client = self._sync_client()
        try:
            values = client.predict(codec.encode(observations), codec.seeds(seeds))
        except Exception as e:  # the transport's errors name the server and field; keep them one line
            if type(e).__name__ == "ActionClientError":
                raise UserError(f"cosmos3 via SGLang: {e}") from None
            raise
        return codec.decode(values)

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
        return {"url": self.url, "num_inference_steps": self.num_inference_steps, "framing": self.framing,
                "seed": self.seed, "normalization": self.normalization, "clip_normalized": self.clip_normalized,
                "framework_module": self.framework_module, "experiment": self.experiment,
                "keys_to_select": list(self.keys_to_select)}
