"""Fused inference weights: [q; k; v] and [gate; up] of every generation block and understanding text layer, so that
each of those projections is one GEMM at inference instead of three / two.

Derived state, never a parameter: the trainer, `state_dict`, checkpoints and exports see only the model's own
q/k/v/gate/up weights. The fused copies are rebuilt when any source weight changes: `get()` compares a key over
the sources (storage address, in-place version counter, dtype, device), so `load_state_dict`, an optimizer step or
`init_weights` (all in place: the version counter moves) and `.to()` (new storage) all invalidate them. Writes that
bypass the version counter (`p.data.copy_(...)`) need an explicit `invalidate()`.

A rebuild with unchanged shapes, dtype and device writes into the existing fused tensors (`torch.cat(out=)`), so a
CUDA graph captured over them stays valid; `storage_generation` counts the rebuilds that had to allocate (the
engine drops its graphs then). Memory: one extra copy of the fused weights (about 2/3 of each tower's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TextLayerWeights:
    qkv: torch.Tensor                 # [wq; wk; wv] (q + 2 kv) * head_dim x hidden
    qkv_bias: torch.Tensor | None     # [bq; bk; bv] when the config has attention biases
    gate_up: torch.Tensor             # [w_gate; w_up] (2 * ffn) x hidden


def _is_sharded(p: torch.Tensor) -> bool:
    return type(p).__name__ == "DTensor"


class FusedWeights:
    """The fused copies of one WamRefModel (see the module docstring). `gen[i]` = (w_qkv, w_gate_up) of generation
    block i (what GenBlock.forward takes as `fused`); `text[i]` = TextLayerWeights of understanding text layer i."""

    def __init__(self, model):
        self.model = model
        self.gen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.text: list[TextLayerWeights] = []
        self.storage_generation = 0
        self._key: tuple | None = None

    def _groups(self) -> list[list[torch.Tensor]]:
        """The source weights, one list per fused tensor, in a fixed order."""
        groups = []
        for blk in self.model.gen.blocks:
            groups.append([blk.q_proj.weight, blk.k_proj.weight, blk.v_proj.weight])
            groups.append([blk.gate_proj.weight, blk.up_proj.weight])
        for layer in self.model.und.language_model.layers:
            a, m = layer.self_attn, layer.mlp
            groups.append([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            if a.q_proj.bias is not None:
                groups.append([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            groups.append([m.gate_proj.weight, m.up_proj.weight])
        return groups

    def _key_of(self, groups) -> tuple:
        return tuple((p.data_ptr(), p._version, p.dtype, p.device, tuple(p.shape)) for g in groups for p in g)

    def invalidate(self) -> None:
        self._key = None

    def available(self) -> bool:
        """False on the meta device and for sharded (FSDP2) parameters: no fusion there."""
        p = next(self.model.gen.parameters())
        return p.device.type != "meta" and not _is_sharded(p)

    @torch.no_grad()
    def get(self) -> "FusedWeights":
        """Self, with the fused copies up to date (rebuilt here when a source weight changed)."""
        groups = self._groups()
        key = self._key_of(groups)
        if key == self._key:
            return self
        old = [w for pair in self.gen for w in pair] + [w for t in self.text
                                                        for w in (t.qkv, t.qkv_bias, t.gate_up) if w is not None]
        fresh = []
        reuse = len(old) == len(groups)
        for i, g in enumerate(groups):
            rows = sum(p.shape[0] for p in g)
            shape = (rows, *g[0].shape[1:])
            if reuse and old[i].shape == shape and old[i].dtype == g[0].dtype and old[i].device == g[0].device:
                fresh.append(torch.cat([p.detach() for p in g], dim=0, out=old[i]))
            else:
                reuse = False
                fresh.append(torch.cat([p.detach() for p in g], dim=0))
        if not reuse:
            self.storage_generation += 1
        it = iter(fresh)
        self.gen = [(next(it), next(it)) for _ in self.model.gen.blocks]
        self.text = []
        for layer in self.model.und.language_model.layers:
            qkv = next(it)
            bias = next(it) if layer.self_attn.q_proj.bias is not None else None
            self.text.append(TextLayerWeights(qkv, bias, next(it)))
        self._key = self._key_of(groups)   # cat(out=) does not touch the sources: same key as computed above
        return self
