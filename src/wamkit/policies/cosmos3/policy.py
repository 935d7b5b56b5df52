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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

import numpy as np

from wamkit.core.config import check_number
from wamkit.core.errors import ConfigError, UserError
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, ChunkConfig, InputSpec, Policy, PolicySpec, RemoteCodec
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


DEFAULT_REQUEST_SEED = 1140          # one seed for every request, as RLinf's evaluation sends (full batches)


class Cosmos3Codec(RemoteCodec):
    """Cosmos3 LIBERO on SGLang: what runs in the evaluation process around the transport."""

    protocol, camera, raw_action_dim = "sglang", "image", C.RAW_ACTION_DIM

    def __init__(self, num_inference_steps: int, framing: str, seed: int | None, pipeline,
                 server_normalizes: bool = False, transport: dict[str, Any] | None = None):
        self.num_inference_steps, self.framing, self.seed = int(num_inference_steps), framing, seed
        self.pipeline, self.server_normalizes = pipeline, bool(server_normalizes)
        self.transport = {k: v for k, v in (transport or {}).items() if v is not None}

    def parameters(self) -> dict[str, Any]:
        return C.cosmos3_parameters(self.num_inference_steps, framing=self.framing)

    def encode(self, observations: Sequence[Observation]) -> list[Observation]:
        return [C.cosmos3_observation(o, framing=self.framing) for o in observations]

    def seeds(self, seeds: Sequence[int]) -> list[int]:
        return [int(s) for s in seeds] if self.seed is None else [int(self.seed)] * len(seeds)

    def decode(self, values: np.ndarray) -> np.ndarray:
        return C.decode_cosmos3_actions(values, self.pipeline)


@dataclass(frozen=True)
class Cosmos3Config(ChunkConfig):
    RENAMED: ClassVar[dict[str, str]] = {"max_batch": "max_request_size"}   # old key spelling (still loads, warns)
    # ---- serving (SGLang)
    url: str | None = None             # the SGLang action server predict() sends to (eval inference=server needs none)
    action_stats: Any = None           # q01/q99 of the 10-D training actions: a dict or a stats JSON path
    action_pipeline: Any = None        # env <-> model actions instead of the one built from action_stats
    action_dim: int = 7                # env action dimension: LIBERO's 7 (the only one Cosmos3 LIBERO produces)
    horizon: int = C.ACTION_HORIZON    # actions per chunk: the 16 Cosmos3 LIBERO was trained with
    num_inference_steps: int = 30      # denoising steps the server runs per request
    clip_normalized: bool = False      # clip normalized actions to [-1, 1] before denormalizing
    token: str | None = None           # bearer token of the server
    timeout_s: float = 300.0           # per request, in seconds
    max_request_size: int | None = None  # most observations in one request; none = the server's max batch size
    framing: str = C.DEFAULT_FRAMING   # prompt/caption framing: recipe | rlinf (wamkit.policies.cosmos3.io)
    seed: int | None = DEFAULT_REQUEST_SEED  # the one seed of every request; none = each observation's own seed
    normalization: Literal["client", "server"] = "client"  # who denormalizes: client (with action_stats) | server
    # ---- training (cosmos-framework)
    framework: bool = False            # build the model with cosmos-framework (training; GPU machine)
    framework_module: str = "cosmos_framework"  # import name of cosmos-framework
    experiment: str = DEFAULT_EXPERIMENT  # cosmos-framework experiment config
    model_path: str | None = None      # warm-start weights (safetensors or DCP directory)
    keys_to_select: tuple[str, ...] = DEFAULT_KEYS_TO_SELECT  # a parameter trains iff its name contains one
    keys_to_skip_loading: tuple[str, ...] = ()  # parameters (name substrings) not loaded from model_path
    ema: bool = False                  # keep cosmos's EMA copy of the network
    vae_path: str | None = None        # Wan VAE weights (else $WAN_VAE_PATH)
    device: str = "cpu"                # where the framework model's tensors go
    client: Any = None                 # injected transport: any object with predict(observations, seeds), close()

    def validate(self) -> None:
        super().validate()
        if self.action_dim != 7:
            raise ConfigError(f"action_dim: cosmos3 (LIBERO) produces 7-D env actions, got {self.action_dim}")
        if self.horizon != C.ACTION_HORIZON:
            raise ConfigError(f"horizon: cosmos3 (LIBERO) was trained with horizon {C.ACTION_HORIZON}, "
                              f"got {self.horizon}")
        C.check_framing(self.framing)
        check_number("num_inference_steps", self.num_inference_steps, lo=1)
        check_number("timeout_s", self.timeout_s, lo=0, lo_open=True)
        check_number("max_request_size", self.max_request_size, lo=1, none_ok=True)
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"seed: cosmos3 seed must be a non-negative integer or null, got {self.seed!r}")
        if self.normalization == "server" and (self.action_stats is not None or self.action_pipeline is not None):
            raise ConfigError("cosmos3 normalization=server means the SGLang server denormalizes (it was started "
                              "with action stats): drop action_stats here, or they would be applied twice")


class Cosmos3Policy(Policy):
    """Cosmos3 (LIBERO): served by SGLang (`url=` for predict(); `wamkit eval inference=server` reaches it through
    remote_codec()), training via cosmos-framework (`framework=True`). See the module docstring; options:
    `Cosmos3Config`."""

    name = "cosmos3"
    config_class = Cosmos3Config

    def __init__(self, config: Cosmos3Config | None = None, **kwargs):
        self.config = cfg = self.make_config(config, **kwargs)
        self.url, self.token, self.timeout_s = cfg.url, cfg.token, cfg.timeout_s
        self.max_request_size = cfg.max_request_size
        self.num_inference_steps = cfg.num_inference_steps
        self.clip_normalized = cfg.clip_normalized
        self.framing = cfg.framing
        self.seed = cfg.seed
        self.normalization = cfg.normalization
        self.action_stats = cfg.action_stats
        if cfg.action_pipeline is not None:
            from wamkit.policies.wam_ref.policy import as_action_pipeline

            self.action_pipeline = as_action_pipeline(cfg.action_pipeline)
        else:
            self.action_pipeline = C.cosmos3_action_pipeline(cfg.action_stats, clip=self.clip_normalized)
        self.framework_module, self.experiment = cfg.framework_module, cfg.experiment
        self.keys_to_select = cfg.keys_to_select
        self.trainable_patterns = tuple(f"*{k}*" for k in self.keys_to_select)
        self.device = cfg.device
        self._client = cfg.client   # injected: any object with predict(observations, seeds) and close()
        self._omni = None
        self._global_step = 0
        if cfg.framework:
            self._omni, _ = build_framework_model(cfg.framework_module, cfg.experiment, cfg.model_path,
                                                  self.keys_to_select, cfg.keys_to_skip_loading, ema=cfg.ema,
                                                  vae_path=cfg.vae_path)
        self.spec = PolicySpec(
            name=self.name,
            input=InputSpec(cameras=C.COSMOS3_CAMERAS, image_size=C.CAMERA_SIZE[0], state_dim=0, text=True),
            action=ActionSpec(dim=7, horizon=C.ACTION_HORIZON, representation="rot6d10"),
            deterministic=True, trainable=cfg.framework,
            extra={"domain": C.LIBERO_DOMAIN, "domain_id": C.LIBERO_DOMAIN_ID, "raw_action_dim": C.RAW_ACTION_DIM,
                   "num_inference_steps": self.num_inference_steps, "url": cfg.url, "framing": self.framing,
                   "seed": self.seed, "normalization": self.normalization})

    # ------------------------------------------------------------------ serving (SGLang)
    def remote_codec(self) -> Cosmos3Codec:
        has_quantile = any(type(s).__name__ == "QuantileNormalizeStep" for s in self.action_pipeline.steps)
        if self.normalization == "client" and not has_quantile:
            raise UserError("cosmos3 returns normalized actions in policy mode: pass action_stats= (q01/q99 of the "
                            "10-D training actions, or the stats JSON) so they can be denormalized, or "
                            "normalization=server if the SGLang server was started with action stats")
        return Cosmos3Codec(self.num_inference_steps, self.framing, self.seed, self.action_pipeline,
                            server_normalizes=self.normalization == "server",
                            transport={"token": self.token, "timeout_s": self.timeout_s,
                                       "max_request_size": self.max_request_size})

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
                                            raw_action_dim=C.RAW_ACTION_DIM, max_request_size=self.max_request_size)
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
        return int(self.max_request_size or 64)

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
