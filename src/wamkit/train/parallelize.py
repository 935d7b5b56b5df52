"""Parallelism applied from outside the model (torchtitan style), in a fixed order:

1. activation checkpointing (composable `checkpoint`: parameter names do not change) on the modules that
   `activation_checkpointing` selects (`select_modules`): none, every FSDP unit (full), the vision tower's units
   (vision), or the outermost modules whose name matches one of a list of globs (any module, also one inside the
   root's FSDP group),
2. torch.compile of the modules that `compile` selects (same forms),
3. `fully_shard` on each unit of `policy.fsdp_units()`, then on the root module.

A module whose forward mutates state outside its outputs cannot be checkpointed: the recomputation in backward
runs it again (wam-ref's understanding-tower text layers append their K/V to the prefix cache: checkpointing them
fails with a shape error; `full` and `vision` do not select them when they train).

The policy's model code stays single-device; it never sees a process group. The same path runs for 1 rank (a
one-rank gloo/NCCL group) and for N ranks.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from wamkit.core.errors import UserError
from wamkit.train.config import module_selection


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
        root.get_submodule(n).compile()


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
    ac = module_selection(activation_checkpointing, "activation_checkpointing")
    apply_activation_checkpointing(root, select_modules(root, units, ac, "activation_checkpointing"))
    apply_compile(root, select_modules(root, units, module_selection(compile, "compile"), "compile"))
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    apply_fsdp(root, units, mesh, mixed_precision_policy(mixed_precision, device_type),
               resolved_reshard(reshard_after_forward, world_size), cast_root_inputs)
    return mesh
