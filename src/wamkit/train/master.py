"""shard=none with bf16 mixed precision: the policy's module computes in bf16, the optimizer updates fp32 master
weights.

    mw = MasterWeights(module)          # module's parameters now hold bf16 copies; mw.state holds the fp32 masters
    opt = build_optimizer(mw.state, ...)
    loss.backward(); mw.grads_to_master(first=True)   # bf16 grads -> the masters' fp32 grads (one multi-tensor copy)
    clip(mw.state); opt.step(); mw.masters_to_model()  # fp32 update, then one multi-tensor copy back to bf16

(`optimizer_impl=triton`, train/master_adamw.py, does the copy in, the clip, the update and the copy back in one
pass per tensor.)

The arithmetic is the FSDP2 path's with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` on one rank:
forward and backward in bf16 over bf16-rounded copies of the fp32 weights, gradients taken to fp32 before clipping
and AdamW (FSDP2: the fp32 "reduction" of one rank), the update on fp32 weights, buffers left in their own dtype,
the root's floating inputs cast to bf16 (`cast_root_inputs`). What it leaves out is FSDP2's per-unit machinery (a
hook pair per unit, a cast-and-copy of every unit's weights per forward and again per backward when resharded,
DTensor dispatch on every optimizer and clip op). Gradient accumulation over micro-steps is fp32 here (each
micro-step's bf16 gradient is added to the fp32 one).

`state` is a module tree with the model's parameter names (FQNs) holding the fp32 masters and the model's persistent
buffers (the same tensors), so `get_state_dict(state, optimizer)`, DCP checkpoints, the EMA and the LR groups see
exactly the names and dtypes an FSDP2 run gives them: a checkpoint written with shard=none resumes with shard=fsdp
on any number of ranks, and the other way round (DCP reshards full tensors <-> DTensor shards).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map


class _Node(nn.Module):
    """A plain container: one level of the master-weight tree."""


def _tree(entries: list[tuple[str, torch.Tensor, bool]]) -> nn.Module:
    """A module whose named parameters / buffers are `entries` (name, tensor, is_parameter) under the given names."""
    root = _Node()
    for name, t, is_param in entries:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            sub = m._modules.get(part)
            if sub is None:
                sub = _Node()
                m.add_module(part, sub)
            m = sub
        if is_param:
            m.register_parameter(leaf, t)
        else:
            m.register_buffer(leaf, t)
    return root


def cast_floating(dtype: torch.dtype):
    """A forward pre-hook (with_kwargs) casting the floating tensors among a module's inputs to `dtype` (what FSDP2's
    `cast_forward_inputs` does for the root)."""
    def cast(x):
        if torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    def hook(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


class MasterWeights:
    """fp32 master weights of `module` (see the module docstring). In place: every parameter of `module` keeps its
    object (compile, activation checkpointing and the policy's references stay valid) but now holds a bf16 copy;
    the fp32 tensor it held becomes the master (no second fp32 copy is made)."""

    def __init__(self, module: nn.Module, param_dtype: torch.dtype = torch.bfloat16, cast_root_inputs: bool = True):
        self.module, self.param_dtype = module, param_dtype
        masters: dict[int, nn.Parameter] = {}
        entries: list[tuple[str, torch.Tensor, bool]] = []
        self._params: list[nn.Parameter] = []      # the module's (compute) parameters, unique, in order
        self._masters: list[nn.Parameter] = []     # their fp32 masters, same order
        for name, p in module.named_parameters(remove_duplicate=False):
            m = masters.get(id(p))
            if m is None:
                m = masters[id(p)] = nn.Parameter(p.data.float(), requires_grad=p.requires_grad)
                with torch.no_grad():
                    p.data = m.data.to(param_dtype)
                self._params.append(p)
                self._masters.append(m)
            entries.append((name, m, True))
        persistent = set(module.state_dict().keys())
        for name, b in module.named_buffers(remove_duplicate=False):
            if name in persistent:
                entries.append((name, b, False))
        self.state = _tree(entries)
        self._trainable = [(p, m) for p, m in zip(self._params, self._masters) if m.requires_grad]
        # set by an optimizer that reads the module's bf16 gradients itself (train/master_adamw.py): an optimizer
        # step of one micro-step then leaves them where backward put them (no fp32 copy)
        self.grads_stay = False
        self._hook = module.register_forward_pre_hook(cast_floating(param_dtype), with_kwargs=True) \
            if cast_root_inputs else None

    def trainable_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(module parameter, its fp32 master) of every trainable parameter."""
        return list(self._trainable)

    @torch.no_grad()
    def grads_to_master(self, first: bool, last: bool = False) -> None:
        """After a micro-step's backward: the module's bf16 gradients into the masters' fp32 ones (copied on the first
        micro-step of an optimizer step, added on the others) and dropped from the module. A master whose parameter
        got no gradient in the step has none (AdamW skips it, as it would skip the parameter). With `grads_stay`, a
        step of one micro-step (first and last) leaves the bf16 gradients on the module for the optimizer to read."""
        if self.grads_stay and first and last:
            for _, m in self._trainable:
                m.grad = None
            return
        cp_dst, cp_src, add_dst, add_src = [], [], [], []
        for p, m in self._trainable:
            g = p.grad
            if g is None:
                if first:
                    m.grad = None
                continue
            p.grad = None
            if m.grad is None:
                m.grad = torch.empty_like(m)
                cp_dst.append(m.grad)
                cp_src.append(g)
            elif first:
                cp_dst.append(m.grad)
                cp_src.append(g)
            else:
                add_dst.append(m.grad)
                add_src.append(g)
        if cp_dst:
            torch._foreach_copy_(cp_dst, cp_src)
        if add_dst:
            torch._foreach_add_(add_dst, add_src)

    @torch.no_grad()
    def masters_to_model(self, trainable_only: bool = True) -> None:
        """The (updated) masters rounded into the module's bf16 parameters: after each optimizer step (trainable
        ones) and after a checkpoint was loaded into `state` (all)."""
        pairs = self._trainable if trainable_only else list(zip(self._params, self._masters))
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def clear_grads(self) -> None:
        """Every trainable gradient dropped, the module's and the masters' (after an optimizer that read them)."""
        for p, m in self._trainable:
            p.grad = None
            m.grad = None

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
