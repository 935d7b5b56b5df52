"""`WamRefConfig`: every option of the reference WAM, its default and what it means (one place).

    WamRefPolicy(size="tiny", horizon=8)                  # keyword arguments, as make_policy passes them
    WamRefPolicy(config=WamRefConfig(size="tiny", horizon=8))

Values arrive typed from Python or as strings from the CLI (`policy_args.cuda_graphs=true`,
`policy_args.cameras=image,wrist_image`); `__post_init__` normalizes them and rejects bad ones (UserError naming the
key). `None` means "the size preset's value" (image_size, max_text_len, gen_*).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch

from wamkit.core.config import parse_bool
from wamkit.core.errors import UserError
from wamkit.policies.wam_ref.sizes import get_size
from wamkit.policies.wam_ref.folded_attention import ATTENTION_CHOICES
from wamkit.policies.wam_ref.skinny import GEMM_CHOICES

# the prefix K/V layouts while denoising (see engine.py's docstring): what kv_layout accepts
KV_LAYOUTS = ("expanded", "room", "folded")
COMPILE_PREFIX = ("layers", "modules")   # compile=true: how the prefix's text layers run (PrefixPass.compile_as)
PREFIX_ATTENTION = ("mask", "causal")     # the prefix's text attention (PrefixPass.causal)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def to_dtype(d) -> torch.dtype:
    """A torch dtype from a dtype or one of the names in DTYPES."""
    if isinstance(d, torch.dtype):
        return d
    if str(d) not in DTYPES:
        raise UserError(f"unknown dtype {d!r}; valid choices: {', '.join(DTYPES)}")
    return DTYPES[str(d)]


def dtype_name(d: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[d]


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The graph a batch of n runs: the smallest bucket >= n (padded up to it), or n itself above every bucket."""
    return min((b for b in buckets if b >= n), default=n)


def graph_buckets(spec, max_batch: int) -> tuple[int, ...]:
    """CUDA-graph batch buckets: given (list or comma string) or 1, 2, 4, 8, 16, then steps of a quarter of the
    next power of two (24, 32, 48, 64, 96, ...) up to max_batch, which is always a bucket."""
    if spec:
        vals = [int(v) for v in (spec.split(",") if isinstance(spec, str) else spec)]
    else:
        vals, b = [], 1
        while b < max_batch:
            vals.append(b)
            b = b * 2 if b < 16 else b + (1 << (b.bit_length() - 1)) // 2
    vals = sorted({v for v in vals if 0 < v < max_batch} | {max_batch})
    return tuple(vals)


def as_action_pipeline(p):
    """None / "identity" -> identity pipeline; "rot6d" -> [Rot6dStep]; dict / JSON path / ActionPipeline."""
    from wamkit.data.transforms import ActionPipeline

    if p is None or p == "identity":
        return ActionPipeline([])
    if p == "rot6d":  # 7-D env actions, 10-D model actions
        from wamkit.data.transforms import Rot6dStep

        return ActionPipeline([Rot6dStep()])
    if isinstance(p, ActionPipeline):
        return p
    if isinstance(p, dict):
        return ActionPipeline.from_dict(p)
    if isinstance(p, (str, Path)):
        return ActionPipeline.load(p)
    raise UserError(f"action_pipeline must be an ActionPipeline, a dict or a path, got {type(p).__name__}")


def model_action_dim(pipe, env_dim: int) -> int:
    try:
        return int(pipe.out_dim(env_dim))
    except ValueError as e:
        raise UserError(f"action pipeline does not fit action_dim={env_dim}: {e}") from None


@dataclass
class WamRefConfig:
    RENAMED: ClassVar[dict[str, str]] = {"max_batch": "max_batch_size"}   # old key spelling (still loads, warns)
    # ---- shape (export_config() writes these; they rebuild the same network)
    size: str = "tiny"                          # size preset (sizes.SIZES): tiny | small | 1b | nano-shape
    action_dim: int = 7                         # env action dimension (what predict returns)
    horizon: int = 16                           # actions per chunk
    cameras: tuple[str, ...] = ("image", "wrist_image")  # camera keys read from Observation.images, in prompt order
    image_size: int | None = None               # square side every camera is resized to; None = the preset's
    state_dim: int = 0                          # proprio state dims (one extra generation token); 0 = no state
    action_pipeline: Any = None                 # env <-> model actions: None/"identity" | "rot6d" | dict | JSON path
    und_path: str | None = None                 # local Qwen3-VL weights dir for the understanding tower (no download)
    und_config: dict | None = None              # Qwen3VLConfig kwargs instead of the preset's (random weights)
    gen_hidden_size: int | None = None          # generation tower width; None = the preset's / understanding tower's
    gen_intermediate_size: int | None = None    # generation tower FFN width; None = the preset's / understanding's
    max_text_len: int | None = None             # task text tokens (right-padded / truncated); None = the preset's
    image_mean: Sequence[float] = (0.5, 0.5, 0.5)  # per-channel normalization of [0, 1] pixels
    image_std: Sequence[float] = (0.5, 0.5, 0.5)
    tokenizer_dir: str | None = None            # local HF tokenizer dir; None = und_path's, else byte-level
    init_seed: int = 0                          # seed of the random initialization (same seed -> same weights)
    # ---- training
    trainable_patterns: Sequence[str] = ("gen.*",)  # globs over parameter names that train; the rest is frozen
    action_lr_multiplier: float = 5.0           # lr multiplier of the action in/out projections
    # ---- inference (none of these changes the arithmetic, only which kernels run)
    num_inference_steps: int = 10               # Euler steps of the flow-matching sampler
    device: str = "cpu"                         # cpu | cuda[:i] | meta (shapes only; materialize() later)
    dtype: Any = "float32"                      # weights / activations: float32 | bfloat16 | float16
    max_batch_size: int = 64                    # largest batch one model call gets (predict splits bigger ones)
    cuda_graphs: bool = False                   # CUDA: the denoising loop is one CUDA graph per batch bucket
    prefix_graphs: bool = True                  # with cuda_graphs: the prefix pass (vision + und) is one too
    fused: bool = True                          # q/k/v and gate/up as one GEMM each (derived weights; off: reference)
    graph_buckets: Sequence[int] | str | None = None  # batch buckets of the graphs; None = 1,2,4,8,16,24,32,...
    kv_layout: str = "folded"                   # prefix K/V while denoising: folded (kv heads, query heads folded:
                                                #   +9.6% at nano batch 64) | expanded (all query heads) | room (kv
                                                #   heads, SDPA with GQA)
    prefix_fold: bool = True                    # the prefix pass's text attention folded as kv_layout=folded folds
                                                #   the loop's (no K/V repeated per query head; with compile_prefix=
                                                #   layers the prefix 2-3% faster at nano batch 64 on an H100); with
                                                #   prefix_attention=mask only
    prefix_attention: str = "causal"            # the prefix pass's text attention: causal (causal SDPA without a
                                                #   mask, GQA in the kernel: the same values, prompts being right-
                                                #   padded; prefix_fold then does not apply; its attention 18.0 ms
                                                #   against 24.3 at nano batch 64 on an H100) | mask (the causal +
                                                #   padding mask built per call)
    compile: bool = False                       # torch.compile of generation blocks, understanding norms/MLPs,
                                                #   vision layers and the prefix's text layers
    compile_prefix: str = "layers"              # compile=true, the prefix's text layers: layers (two compiled
                                                #   functions around attention: residual adds fused into the norms,
                                                #   q/k norms with the rotary, q written folded) | modules (each
                                                #   norm, MLP and the rotary compiled on its own, as until session 24)
    batched_vision_attention: bool = True       # one attention call over all (equal-size) images per vision layer
    gemm: str = "cublas"                        # denoising-loop GEMMs: cublas (F.linear) | triton (skinny.py's split-K
                                                #   kernel for <= 64 rows, tuned on first use) | autotune (Inductor
                                                #   max-autotune of the generation blocks' compiled functions)
    attention: str = "triton"                   # the loop's folded attention (kv_layout=folded): triton
                                                #   (folded_attention.py's kernel, split over the keys at small
                                                #   batch; on CUDA or Triton's interpreter, else SDPA; 51.0 us a block
                                                #   and step against cuDNN's 55.3 at nano batch 64 on an H100, batch 1
                                                #   207 ms against 210.5) | sdpa
    residual_carry: bool = True                 # compile=true, gemm=cublas: each generation block's MLP residual is
                                                #   added by the next block, in the kernel of its first norm (one
                                                #   elementwise kernel a block and step less; GenBlock.defers)

    def __post_init__(self) -> None:
        get_size(self.size)  # unknown size: UserError listing the sizes
        if isinstance(self.cameras, str):
            self.cameras = tuple(self.cameras.split(","))
        self.cameras = tuple(self.cameras)
        self.cuda_graphs = parse_bool(self.cuda_graphs, "cuda_graphs")
        self.prefix_graphs = parse_bool(self.prefix_graphs, "prefix_graphs")
        self.fused = parse_bool(self.fused, "fused")
        if self.kv_layout not in KV_LAYOUTS:
            raise UserError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        self.compile = parse_bool(self.compile, "compile")
        self.prefix_fold = parse_bool(self.prefix_fold, "prefix_fold")
        if self.prefix_attention not in PREFIX_ATTENTION:
            raise UserError(f"prefix_attention must be one of {', '.join(PREFIX_ATTENTION)}, "
                            f"got {self.prefix_attention!r}")
        if self.compile_prefix not in COMPILE_PREFIX:
            raise UserError(f"compile_prefix must be one of {', '.join(COMPILE_PREFIX)}, got {self.compile_prefix!r}")
        self.gemm = str(self.gemm).lower()
        if self.gemm not in GEMM_CHOICES:
            raise UserError(f"gemm must be one of {', '.join(GEMM_CHOICES)}, got {self.gemm!r}")
        self.attention = str(self.attention).lower()
        if self.attention not in ATTENTION_CHOICES:
            raise UserError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {self.attention!r}")
        self.batched_vision_attention = parse_bool(self.batched_vision_attention, "batched_vision_attention")
        self.residual_carry = parse_bool(self.residual_carry, "residual_carry")
        for k in ("action_dim", "horizon", "state_dim", "num_inference_steps", "init_seed", "max_batch_size"):
            setattr(self, k, int(getattr(self, k)))
        for k in ("image_size", "max_text_len", "gen_hidden_size", "gen_intermediate_size"):
            if getattr(self, k) is not None:
                setattr(self, k, int(getattr(self, k)))
        self.action_lr_multiplier = float(self.action_lr_multiplier)
        self.trainable_patterns = tuple(self.trainable_patterns)
        self.image_mean = tuple(float(v) for v in self.image_mean)
        self.image_std = tuple(float(v) for v in self.image_std)
        to_dtype(self.dtype)  # unknown dtype: UserError listing the names

    @classmethod
    def from_kwargs(cls, **kwargs) -> "WamRefConfig":
        """The config of these constructor kwargs; a key that is not an option is a ConfigError naming it."""
        from wamkit.core.config import check_options

        return cls(**check_options("policy_args", "wam-ref", cls, kwargs))

    @property
    def torch_dtype(self) -> torch.dtype:
        return to_dtype(self.dtype)

    @property
    def buckets(self) -> tuple[int, ...]:
        return graph_buckets(self.graph_buckets, self.max_batch_size)


@dataclass
class Placement:
    """Where the weights live now. One object shared by the policy, its input processor and its inference engine,
    so that `materialize(device)` moves all three at once."""

    device: torch.device
    dtype: torch.dtype
