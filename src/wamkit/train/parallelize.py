"""Parallelism applied from outside the model (torchtitan style), in a fixed order:

1. activation checkpointing on each FSDP unit (composable `checkpoint`: parameter names do not change),
2. torch.compile of each unit (optional),
3. `fully_shard` on each unit of `policy.fsdp_units()`, then on the root module.

The policy's model code stays single-device; it never sees a process group. The same path runs for 1 rank (a
one-rank gloo/NCCL group) and for N ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


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


def apply_activation_checkpointing(units: list[nn.Module]) -> None:
    from torch.distributed._composable import checkpoint

    for u in units:
        checkpoint(u)


def apply_compile(units: list[nn.Module]) -> None:
    for u in units:
        u.compile()


def apply_fsdp(root: nn.Module, units: list[nn.Module], mesh: DeviceMesh, mp: MixedPrecisionPolicy | None) -> None:
    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    for u in units:
        fully_shard(u, **kw)
    fully_shard(root, **kw)


def parallelize(root: nn.Module, units: list[nn.Module], device_type: str, world_size: int, *,
                mixed_precision: str = "auto", activation_checkpointing: bool = False,
                compile: bool = False) -> DeviceMesh:
    """Shard `root` (in place) over a 1-D mesh of all ranks; returns the mesh. `root` must be fp32."""
    units = [u for u in units if u is not root]
    if activation_checkpointing:
        apply_activation_checkpointing(units)
    if compile:
        apply_compile(units)
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    apply_fsdp(root, units, mesh, mixed_precision_policy(mixed_precision, device_type))
    return mesh
