"""Parallelism applied from outside the model (torchtitan style). `setup_model` is the entry point; `shard` picks the
path (`resolved_shard`: auto = FSDP2 on more than one rank, none on one, as torchtitan applies FSDP only when
dp_shard > 1). FSDP2 (`parallelize`), in a fixed order:

1. activation checkpointing (composable `checkpoint`: parameter names do not change) on the modules that
   `activation_checkpointing` selects (`select_modules`): none, every FSDP unit (full), the vision tower's units
   (vision), or the outermost modules whose name matches one of a list of globs (any module, also one inside the
   root's FSDP group),
2. torch.compile of the modules that `compile` selects (same forms),
3. `fully_shard` on each unit of `policy.fsdp_units()`, then on the root module.

A module whose forward mutates state outside its outputs cannot be checkpointed: the recomputation in backward
runs it again (wam-ref's understanding-tower text layers append their K/V to the prefix cache: checkpointing them
fails with a shape error; `full` and `vision` do not select them when they train).

shard=none (one rank): the same activation checkpointing and compile (plus `compile=model`: the whole root module,
which FSDP2's hooks would split), no `fully_shard`; with bf16 mixed precision the module computes in bf16 and the
optimizer updates fp32 master weights (train/master.py: the FSDP2 path's arithmetic without its per-unit work).

The policy's model code stays single-device; it never sees a process group. Checkpoints, the optimizer and the EMA
see `TrainModel.state`, whose parameter names are the module's on every path.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from wamkit.core.errors import UserError
from wamkit.train.config import COMPILE_MODEL_AC, WHOLE_MODEL, module_selection
from wamkit.train.master import MasterWeights


def mixed_precision_policy(mode: str, device_type: str) -> MixedPrecisionPolicy | None:
    """auto: bf16 compute/all-gather with fp32 gradient reduction on GPU, plain fp32 on CPU. Master weights (the
    sharded parameters the optimizer updates) are always fp32."""
    if mode == "auto":
        mode = "bf16" if device_type == "cuda" else "fp32"
    if mode == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def resolved_precision(mode: str, device_type: str) -> str:
    return ("bf16" if device_type == "cuda" else "fp32") if mode == "auto" else mode


VISION_NAMES = ("visual", "vision", "vision_tower", "vision_model")   # a module-name component of a vision tower


def select_modules(root: nn.Module, units: list[nn.Module], mode: str, key: str = "activation_checkpointing"
                   ) -> list[str]:
    """Qualified names (in `root`) of the modules a selection picks (TrainConfig.activation_checkpointing /
    compile; module_selection normalizes it). full: every unit; vision: the units with a name component in
    VISION_NAMES; globs: the outermost modules whose name matches one (a glob that matches nothing is a UserError
    naming it). Nested selections are dropped (checkpointing inside a checkpointed module only recomputes twice;
    a compiled module already covers its children)."""
    if mode == "none":
        return []
    if mode == WHOLE_MODEL:
        return [""]
    names = {id(m): n for n, m in root.named_modules()}
    if mode in ("full", "vision"):
        picked = [names[id(u)] for u in units if id(u) in names and u is not root]
        if mode == "vision":
            picked = [n for n in picked if any(c in VISION_NAMES for c in n.split("."))]
            if not picked:
                raise UserError(f"{key}=vision: no FSDP unit of this policy is in a vision tower "
                                f"(a name component among {', '.join(VISION_NAMES)}); pass module-name globs instead")
        return picked
    globs = mode.split(",")
    all_names = [n for n, _ in root.named_modules() if n]
    bad = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n in all_names)]
    if bad:
        sample = ", ".join(all_names[:8]) + (f", ... ({len(all_names)} in all)" if len(all_names) > 8 else "")
        raise UserError(f"{key} glob(s) {bad} match no module; modules are: {sample}")
    picked: list[str] = []
    for n in all_names:   # named_modules is parent-first: an ancestor is seen before its children
        if any(fnmatch.fnmatchcase(n, g) for g in globs) and not any(n.startswith(p + ".") for p in picked):
            picked.append(n)
    return picked


def apply_activation_checkpointing(root: nn.Module, names: list[str]) -> None:
    from torch.distributed._composable import checkpoint

    for n in names:
        checkpoint(root.get_submodule(n))


def checkpoint_targets(root: nn.Module, units: list[nn.Module], mode: str) -> list[str]:
    return select_modules(root, units, mode, "activation_checkpointing")


def apply_compile(root: nn.Module, names: list[str]) -> None:
    """torch.compile each selected module. Modules of one class share a code object, and a module that differs by
    a guarded attribute (transformers' decoder layers: `layer_idx`) is one recompilation each: the recompile limit
    (8 by default, then the rest silently run eagerly) is raised to the number of modules (a process-wide setting)."""
    if not names:
        return
    import torch._dynamo

    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, key, max(getattr(cfg, key), len(names) + 8))
    for n in names:
        root.get_submodule(n).compile()   # "" (compile=model): the root itself


def resolved_reshard(value, world_size: int) -> bool:
    """reshard_after_forward (auto | true | false, or a bool) -> bool. auto: false on one rank, where the gathered
    weights are a bf16 copy of the rank's own and re-gathering them in backward is a second cast-and-copy per weight;
    true on more ranks (FSDP2's default: frees them between forward and backward)."""
    if isinstance(value, bool):
        return value
    v = str(value).lower()
    if v == "auto":
        return world_size > 1
    return v in ("true", "1", "yes", "on")


def apply_fsdp(root: nn.Module, units: list[nn.Module], mesh: DeviceMesh, mp: MixedPrecisionPolicy | None,
               reshard_after_forward: bool = True, cast_root_inputs: bool = True) -> None:
    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    for u in units:
        fully_shard(u, reshard_after_forward=reshard_after_forward, **kw)
    if mp is not None and not cast_root_inputs:
        kw["mp_policy"] = dataclasses.replace(mp, cast_forward_inputs=False)
    fully_shard(root, **kw)   # the root keeps its weights gathered from forward to backward (FSDP2's default)


def parallelize(root: nn.Module, units: list[nn.Module], device_type: str, world_size: int, *,
                mixed_precision: str = "auto", activation_checkpointing: str | bool = "none",
                compile: str | bool = "none", reshard_after_forward: str | bool = "true",
                cast_root_inputs: bool = True) -> DeviceMesh:
    """Shard `root` (in place) over a 1-D mesh of all ranks; returns the mesh. `root` must be fp32.
    activation_checkpointing, compile: TrainConfig values (none | full | vision | globs; true/false = full/none).
    cast_root_inputs=False: the root's floating inputs reach its forward as given (with bf16 mixed precision FSDP2
    would cast them to bf16: wam-ref's flow time t and regression target would be rounded to bf16); the units'
    inputs are cast as before."""
    units = [u for u in units if u is not root]
    comp = module_selection(compile, "compile", allow_model=True)
    if comp == WHOLE_MODEL:
        raise UserError("compile=model compiles the whole module in one graph, which FSDP2's per-unit hooks would "
                        "split: use it with shard=none (one rank), or compile the units (compile=full) with FSDP")
    ac = module_selection(activation_checkpointing, "activation_checkpointing")
    apply_activation_checkpointing(root, select_modules(root, units, ac, "activation_checkpointing"))
    apply_compile(root, select_modules(root, units, comp, "compile"))
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    apply_fsdp(root, units, mesh, mixed_precision_policy(mixed_precision, device_type),
               resolved_reshard(reshard_after_forward, world_size), cast_root_inputs)
    return mesh


# ------------------------------------------------------------------------------------------------ shard=auto|fsdp|none

def resolved_shard(value: str, world_size: int) -> str:
    """shard (auto | fsdp | none) -> fsdp | none. auto: none on one rank, fsdp on more. none on more than one rank
    is a UserError (nothing would keep the ranks' weights in step)."""
    v = str(value).lower()
    if v == "auto":
        return "fsdp" if world_size > 1 else "none"
    if v == "none" and world_size > 1:
        raise UserError(f"shard=none trains on one rank; {world_size} ranks need shard=fsdp (or auto)")
    if v not in ("fsdp", "none"):
        raise UserError(f"shard must be auto, fsdp or none, got {value!r}")
    return v


class TrainModel:
    """What `setup_model` made of a policy's module, and the few calls of the loop that differ between the paths.

    module: what the policy computes with (FSDP2-sharded in place, or the plain module); state: the module whose
    parameters the optimizer, the EMA, gradient clipping and checkpoints use (the module itself, or the fp32 master
    weights of shard=none + bf16) under the same names."""

    def __init__(self, module: nn.Module, shard: str, precision: str, master: MasterWeights | None = None):
        self.module, self.shard, self.precision, self.master = module, shard, precision, master
        self.state = master.state if master is not None else module

    def before_backward(self, last_micro_step: bool) -> None:
        """FSDP2: reduce-scatter the gradients only on the last micro-step of an optimizer step."""
        if self.shard == "fsdp":
            self.module.set_requires_gradient_sync(last_micro_step)

    def after_backward(self, first_micro_step: bool, last_micro_step: bool = False) -> None:
        if self.master is not None:
            self.master.grads_to_master(first_micro_step, last_micro_step)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The updated weights into the compute copies, and the gradients cleared for the next step (the masters'
        fp32 gradients are kept allocated: the next step overwrites them). An optimizer that writes the compute
        copies itself (MasterAdamW: `writes_model`) has done both."""
        if getattr(optimizer, "writes_model", False):
            return
        if self.master is not None:
            self.master.masters_to_model()
        else:
            optimizer.zero_grad(set_to_none=True)

    def after_load(self) -> None:
        """A checkpoint was loaded into `state`: into the compute copies too."""
        if self.master is not None:
            self.master.masters_to_model(trainable_only=False)


def setup_model(root: nn.Module, units: list[nn.Module], device_type: str, world_size: int, *, shard: str = "auto",
                mixed_precision: str = "auto", activation_checkpointing: str | bool = "none",
                compile: str | bool = "none", reshard_after_forward: str | bool = "true",
                cast_root_inputs: bool = True, init=None) -> TrainModel:
    """The module `root` (fp32, possibly on the meta device) made ready to train, in place. init: a callable run once
    the parameters have their final layout (a meta-built policy's `init_weights(device)`): after `fully_shard`
    (each rank fills its shards), or before the bf16 copies of shard=none are made."""
    mode = resolved_shard(shard, world_size)
    precision = resolved_precision(mixed_precision, device_type)
    if mode == "fsdp":
        parallelize(root, units, device_type, world_size, mixed_precision=mixed_precision,
                    activation_checkpointing=activation_checkpointing, compile=compile,
                    reshard_after_forward=reshard_after_forward, cast_root_inputs=cast_root_inputs)
        if init is not None:
            init()
        return TrainModel(root, mode, precision)
    units = [u for u in units if u is not root]
    ac = module_selection(activation_checkpointing, "activation_checkpointing")
    comp = module_selection(compile, "compile", allow_model=True)
    if comp == WHOLE_MODEL and ac != "none":
        raise UserError(COMPILE_MODEL_AC)
    apply_activation_checkpointing(root, select_modules(root, units, ac, "activation_checkpointing"))
    apply_compile(root, select_modules(root, units, comp, "compile"))
    if init is not None:
        init()
    master = MasterWeights(root, torch.bfloat16, cast_root_inputs) if precision == "bf16" else None
    return TrainModel(root, mode, precision, master)
