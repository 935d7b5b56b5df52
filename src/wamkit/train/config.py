"""`TrainConfig`: every knob of `wamkit train`, defaults next to the code.

    cfg = load_config(TrainConfig, "train.yaml", ["policy=wam-ref", "policy_args.size=tiny", "steps=2000"])

Defaults follow NVIDIA's Cosmos3 LIBERO SFT recipe (docs/training.md): AdamW lr 5e-5 betas (0.9, 0.99) eps 1e-8,
weight decay 0.05, grad clip 1.0, linear warmup then linear decay to 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from wamkit.core.config import check_number
from wamkit.core.errors import ConfigError


@dataclass
class TrainConfig:
    # what to train
    policy: str = "wam-ref"                 # registry name, an exported dir, or "package.module:Class"
    policy_args: dict = field(default_factory=dict)  # constructor kwargs of the policy (e.g. size: tiny)
    # data
    dataset: str = ""                       # LeRobot v3 dataset dir, or "package.module:function" (custom source)
    fps: float | None = None                # the fps the recipe expects; the dataset's must match (required)
    allow_fps_mismatch: bool = False        # train anyway on a dataset with another fps (wrong time scale!)
    cameras: list[str] = field(default_factory=list)  # [] = the policy's spec.input.cameras
    horizon: int = 0                        # 0 = the policy's spec.action.horizon
    representation: str = ""                # "" = the policy's spec.action.representation
    num_workers: int = 2                    # DataLoader worker processes per rank
    # batch and schedule
    batch_size: int = 32                    # GLOBAL batch (all ranks x all accumulation micro-steps)
    grad_accum: int = 1                     # micro-steps per optimizer step
    steps: int = 2000                       # optimizer steps of the whole schedule
    stop_at: int = 0                        # stop (with a checkpoint) after this step; 0 = run to `steps`
    lr: float = 5e-5                        # peak learning rate (AdamW)
    betas: tuple[float, float] = (0.9, 0.99)  # AdamW betas
    eps: float = 1e-8                       # AdamW epsilon
    weight_decay: float = 0.05              # applied to >= 2-D parameters only (not biases / norms)
    optimizer_impl: Literal["auto", "fused", "foreach", "for-loop", "triton"] = "auto"  # AdamW kernels; auto: fused
                                            # on CUDA, foreach elsewhere; triton: shard=none + bf16 only, one pass
                                            # from the bf16 gradient to the bf16 weight (train/master_adamw.py)
    warmup: int = 500                       # linear warmup steps (from lr/warmup to lr)
    decay: int | None = None                # linear decay to 0 over this many steps after warmup; None = to `steps`;
                                            # 0 = constant after warmup
    grad_clip: float = 1.0                  # max global grad norm; 0 = no clipping (the norm is still logged)
    lr_multipliers: dict = field(default_factory=dict)  # glob -> lr multiplier; {} = policy.lr_multipliers()
    trainable: list[str] = field(default_factory=list)  # globs of trainable params; [] = policy.trainable_patterns
    ema: float = 0.0                        # EMA decay of the weights (e.g. 0.999); 0 = off
    # parallelism / numerics
    nproc: int = 1                          # ranks; > 1 relaunches under torchrun (ignored when already under it)
    shard: Literal["auto", "fsdp", "none"] = "auto"  # fsdp: fully_shard (FSDP2) the units and the root; none: a
                                            # plain module (one rank only): bf16 weights for compute, fp32 master
                                            # weights in the optimizer (train/master.py); auto: none on one rank,
                                            # fsdp on more (torchtitan applies FSDP only when dp_shard > 1)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when a GPU is present, else cpu
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 params/fp32 reduce on GPU, fp32 on CPU
    activation_checkpointing: str = "none"  # recompute activations in backward (less memory, more compute):
                                            # none | full (every FSDP unit) | vision (the vision tower's units) |
                                            # comma-separated globs of module names; true/false = full/none
    cast_root_inputs: bool = True           # bf16: FSDP2 (shard=none: a pre-hook) casts the root module's floating
                                            # forward inputs to bf16 (wam-ref: actions, noise, flow time t); false
                                            # keeps them as given (the model casts where it computes; wam-ref does)
    reshard_after_forward: Literal["auto", "true", "false"] = "true"  # FSDP2: free the gathered bf16 weights of
                                            # each unit after its forward (and gather again in backward); auto:
                                            # false on one rank (nothing to save there but a copy per weight)
    compile: str = "none"                   # torch.compile per module: none | full (every FSDP unit) | vision |
                                            # model (the whole root module; shard=none, no activation
                                            # checkpointing) | comma-separated globs of module names;
                                            # true/false = full/none
    gc_every: int = 0                       # 0: Python's automatic garbage collection; N: automatic GC off, one
                                            # collection every N steps (no GC pause inside a step)
    seed: int = 0                           # model init, data order and noise seed
    # outputs
    out: str = "runs/train"                 # run dir: checkpoints/, train_log.jsonl, tb/, config.json
    save_every: int = 500                   # checkpoint every N steps (and at the end); 0 = only at the end
    keep_last: int = 2                      # checkpoints kept (oldest deleted)
    resume: bool = False                    # continue from the newest checkpoint under out/checkpoints
    trust_checkpoint: bool = False          # resume from a checkpoint another user owns (its optimizer state is
                                            # read through pickle by torch DCP, which can run code)
    overwrite: bool = False                 # out= already holds a run: delete its checkpoints and logs, start anew
    log_every: int = 10                     # TensorBoard + train_log.jsonl + console every N steps
    progress: bool = True                   # rich progress bar on rank 0
    logger: Literal["tensorboard", "wandb"] = "tensorboard"  # wandb: also log to Weights & Biases (pip install
                                            # wandb; WANDB_MODE=offline works without an account)
    wandb_project: str = "wamkit"           # the W&B project of logger=wandb (run name: the out= dir's name)

    def validate(self) -> None:
        for n in ("batch_size", "grad_accum", "steps", "log_every", "nproc", "keep_last"):
            check_number(n, getattr(self, n), 1)
        for n in ("warmup", "save_every", "num_workers", "stop_at", "horizon", "grad_clip", "weight_decay"):
            check_number(n, getattr(self, n), 0)
        check_number("seed", self.seed, 0, 2**63 - 1)
        check_number("decay", self.decay, 0, none_ok=True)
        check_number("fps", self.fps, 0, lo_open=True, none_ok=True)
        check_number("lr", self.lr, 0, lo_open=True)
        check_number("eps", self.eps, 0, lo_open=True)
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"ema must be in [0, 1), got {self.ema}")
        for k, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ConfigError(f"betas[{k}] must be in [0, 1), got {b}")
        if len(self.betas) != 2:
            raise ConfigError(f"betas must be two numbers, got {list(self.betas)}")
        if not self.out.strip() or self.out == "None":   # "None": YAML `out: null` (or `out:`), made a str
            raise ConfigError("out must name the run directory, got " + ("null" if self.out == "None" else
                              f"{self.out!r} (an empty out= would train into the current directory)"))
        if self.resume and self.overwrite:
            raise ConfigError("resume=true and overwrite=true contradict each other; pick one")
        self.lr_multipliers = _flat_multipliers(self.lr_multipliers)
        check_number("gc_every", self.gc_every, 0)
        self.activation_checkpointing = module_selection(self.activation_checkpointing, "activation_checkpointing")
        self.compile = module_selection(self.compile, "compile", allow_model=True)
        if self.compile == WHOLE_MODEL and self.activation_checkpointing != "none":
            raise ConfigError(COMPILE_MODEL_AC)
        if self.shard == "none" and self.nproc > 1:
            raise ConfigError(f"shard=none trains on one rank; nproc={self.nproc} needs shard=fsdp (or auto)")


SELECTION_MODES = ("none", "full", "vision")
WHOLE_MODEL = "model"   # compile only: the root module itself (one graph, no FSDP hooks in it: shard=none)
COMPILE_MODEL_AC = ("compile=model needs activation_checkpointing=none: the composable checkpoint's recomputation "
                    "does not match a whole-model compiled forward (torch.utils.checkpoint CheckpointError); compile "
                    "the units instead (compile=full or globs) to combine both")


def module_selection(value, key: str = "activation_checkpointing", allow_model: bool = False) -> str:
    """A module selection (activation_checkpointing, compile) as given (bool, true/false/yes/no/1/0, a mode, or
    globs) -> none | full | vision | model (allow_model: compile) | 'glob,glob'. The globs are checked against the
    model's module names in parallelize.py (select_modules)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    v = str(value).strip()
    low = v.lower()
    if low in ("true", "yes", "on", "1"):
        return "full"
    if low in ("false", "no", "off", "0", ""):
        return "none"
    if low in SELECTION_MODES or (allow_model and low == WHOLE_MODEL):
        return low
    globs = [g.strip() for g in v.split(",")]
    if any(not g or any(c.isspace() for c in g) for g in globs):
        modes = "none, full, vision" + (", model" if allow_model else "")
        raise ConfigError(f"{key} must be {modes} or comma-separated module-name globs, got {value!r}")
    return ",".join(globs)


def ac_mode(value) -> str:
    return module_selection(value, "activation_checkpointing")


def _flat_multipliers(d: dict, prefix: str = "") -> dict[str, float]:
    """`lr_multipliers.gen.action_in.*=5` arrives nested ({"gen": {"action_in": {"*": "5"}}}): flatten the dotted
    glob back and make the values floats."""
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_multipliers(v, key + "."))
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = -1.0
        if isinstance(v, bool) or not 0 <= f < math.inf:     # NaN fails both comparisons; inf trains NaN weights
            raise ConfigError(f"lr_multipliers.{key} must be a finite number >= 0, got {v!r}")
        out[key] = f
    return out
