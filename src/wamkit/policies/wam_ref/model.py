"""wam-ref network: a Qwen3-VL understanding tower (transformers, wrapped) + our flow-matching generation tower.

Mixture-of-Transformers layout, Cosmos3-style:
- Understanding tower (`und`): transformers' `Qwen3VLModel`, run once per observation over
  `[<vision_start> <image_pad>*n <vision_end>] * cameras + task text (right-padded to a fixed length)` with
  `use_cache=True`. Its `DynamicCache` holds, per decoder layer, the keys (after k_norm and mRoPE) and values of the
  prefix: `out.cache.layers[i].keys / .values`, shape (B, kv_heads, S, head_dim). That is the whole interface.
- Generation tower (`gen`): one block per understanding layer, same head layout (heads, kv heads, head_dim). Block i
  projects the action tokens (+ an optional proprio-state token) to q/k/v and attends to [prefix K/V of layer i ;
  its own K/V] with full (non-causal) attention; prefix padding is masked. Time conditioning is AdaLN-single: one
  shared time MLP produces 6 modulation vectors, each block adds its own learned table (shift/scale/gate for
  attention and MLP). Action tokens get text-style mRoPE positions continuing after the prefix.
- Flow matching: x_t = (1 - t) * noise + t * actions, target velocity actions - noise, t ~ logit-normal in training;
  sampling integrates t: 0 -> 1 with Euler steps.

Model code is single-device; FSDP / compile / checkpointing are applied from outside (see `fsdp_units`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from wamkit.policies.wam_ref import folded_attention as _folded
from wamkit.policies.wam_ref import skinny as _skinny
from wamkit.policies.wam_ref.skinny import linear as _linear


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B, heads, L, hd) or (B, kv_heads, group, L, hd); cos/sin (B, L, hd)
    at = (slice(None),) + (None,) * (x.dim() - 3)
    return x * cos[at] + _rotate_half(x) * sin[at]


@dataclass
class Prefix:
    """The understanding tower's per-layer keys/values for a batch of observations (computed once per observation)."""

    keys: list[torch.Tensor]        # per layer (B, kv_heads, S, head_dim)
    values: list[torch.Tensor]
    key_mask: torch.Tensor          # (B, S) bool: True = real token
    next_pos: torch.Tensor          # (B,) first mRoPE position after the prefix

    @property
    def batch_size(self) -> int:
        return int(self.key_mask.shape[0])

    def with_room(self, n: int, heads: int) -> "Prefix":
        """The same prefix in the inference layout: per layer (B, heads, S + n, hd) with the last n slots free for
        the action tokens' K/V (each denoising step writes them in place instead of concatenating the whole prefix
        again), the K/V heads repeated up to `heads` (a multiple of the kv heads; = kv heads: no repeat), and the
        key mask covering the n slots."""
        b, kvh, s, hd = self.keys[0].shape
        keys = [kv_room_buffer(k, n, heads) for k in self.keys]
        values = [kv_room_buffer(v, n, heads) for v in self.values]
        mask = torch.cat([self.key_mask, torch.ones(b, n, dtype=torch.bool, device=self.key_mask.device)], dim=1)
        return Prefix(keys, values, mask, self.next_pos)


def head_dim_of(text_config) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def heads_slots(dst: torch.Tensor, b: int, kv_heads: int, start: int, length: int) -> torch.Tensor:
    """The view of dst (B', heads, slots, hd) that a (b, kv_heads, length, hd) tensor fills at slots
    start:start + length with its kv heads repeated up to dst's head count, kv-head-major (as
    `repeat_interleave(heads // kv_heads, dim=1)` orders them): (b, kv_heads, heads // kv_heads, length, hd), written
    as `view.copy_(src[:, :, None])`."""
    heads, slots, hd = dst.shape[1], dst.shape[2], dst.shape[3]
    if heads % kv_heads:
        raise ValueError(f"heads {heads} is not a multiple of kv heads {kv_heads}")
    return dst[:b].view(b, kv_heads, heads // kv_heads, slots, hd)[:, :, :, start:start + length]


def write_heads(dst: torch.Tensor, src: torch.Tensor, start: int) -> None:
    """dst[:B, :, start:start + L] = src (B, kv_heads, L, hd), the kv heads repeated (see heads_slots); in place, no
    allocation."""
    b, kvh, length, _ = src.shape
    heads_slots(dst, b, kvh, start, length).copy_(src[:, :, None])


def kv_room_buffer(src: torch.Tensor, n: int, heads: int) -> torch.Tensor:
    """(B, kv_heads, S, hd) -> a new (B, heads, S + n, hd) buffer with src in the first S slots (see write_heads)."""
    b, _, s, hd = src.shape
    out = src.new_zeros(b, heads, s + n, hd)
    write_heads(out, src, 0)
    return out


def _project(h: torch.Tensor, w, sizes: tuple[int, ...], gemm: str = "cublas") -> tuple[torch.Tensor, ...]:
    """Several projections of h: w is a tuple of weights (one GEMM each: the training path) or one tensor, their
    row-wise concatenation (one GEMM, split after: the fused inference path, see fused.FusedWeights). gemm: which
    kernel runs the GEMMs (skinny.linear)."""
    if isinstance(w, torch.Tensor):
        return _linear(h, w, gemm).split(sizes, dim=-1)
    return tuple(_linear(h, wi, gemm) for wi in w)


def additive_mask(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) bool key mask (True = attend) -> (B, 1, 1, S) additive mask in `dtype`: what SDPA itself builds from a
    boolean mask on every call (0 where attended; masked: -inf, or on CUDA -65504, the value of its cuDNN path), so
    the denoising loop builds it once per call instead of once per block and step (three small kernels each)."""
    fill = -65504.0 if key_mask.is_cuda and dtype in (torch.float16, torch.bfloat16) else float("-inf")
    return torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device).masked_fill(~key_mask, fill)[:, None, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
           fold: bool = False, attention: str = "sdpa") -> torch.Tensor:
    """SDPA of q (B, H, n, hd) over k/v (B, Hkv, S, hd), H a multiple of Hkv (query head j reads kv head
    j // (H // Hkv), as enable_gqa orders them), with a mask over keys only ((B, 1, 1, S) or None: no causal
    structure). fold=True computes grouped-query attention as plain attention over the Hkv heads (see
    fold_queries, attend_folded, which `attention` goes to)."""
    h, kvh = q.shape[1], k.shape[1]
    if kvh == h:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    if not fold:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
    return attend_folded(fold_queries(q, kvh), k, v, attn_mask, h, attention)


def fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q (B, H, n, hd) -> (B, Hkv, H // Hkv * n, hd): each kv head's group of query heads stacked along the query
    axis (a copy unless q's heads and tokens are laid out (group, n) contiguously; the block computes q in this
    layout itself with fold_q, see _folded_queries)."""
    b, h, n, hd = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * n, hd)


def attend_folded(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                  heads: int, attention: str = "sdpa") -> torch.Tensor:
    """Grouped-query attention of folded queries qf (fold_queries) as plain attention over the Hkv heads; returns
    (B, heads, n, hd). Exact because no query row depends on another or on its position, and every SDPA kernel
    takes it (no enable_gqa): each group's K/V is read once for all its query heads (a quarter of
    kv_layout=expanded's bytes at 32 / 8 heads) and a kernel's query tile holds 4x the rows. attention="triton":
    folded_attention.py's kernel where it applies (its output written token-major, (B, n, heads, hd) contiguous,
    returned transposed: the output projection then reads it without a copy), else SDPA."""
    b, kvh, gn, hd = qf.shape
    if attn_mask is not None and attn_mask.shape[-2] != 1:
        raise ValueError(f"folded attention needs a mask over keys only, got mask shape {tuple(attn_mask.shape)}")
    if _folded.applies(qf, attention):
        return _folded.folded_attention(qf, k, v, attn_mask, tokens=gn * kvh // heads).transpose(1, 2)
    a = F.scaled_dot_product_attention(qf, k, v, attn_mask=attn_mask)
    # reshape, not view: the memory-efficient backend returns its output strided as (B, S, H, hd) transposed, which
    # cannot be viewed as (B, H, n, hd) (cuDNN's and math's are contiguous: there reshape is a view)
    return a.reshape(b, heads, gn * kvh // heads, hd)


def split_carry(out) -> tuple[torch.Tensor, tuple | None]:
    """A GenBlock's output -> (x, carry): carry (MLP output, gate) where the block deferred its residual
    (GenBlock.defers), for the next block's forward; else None."""
    return (out[0], out[1:]) if isinstance(out, tuple) else (out, None)


def add_carry(x: torch.Tensor, carry) -> torch.Tensor:
    """x with a carried residual added (by the next block's _block_in, or after the last block of a chain)."""
    return x if carry is None else x + carry[1][:, None] * carry[0]


def _block_in(x, tmod, modulation, w_qkv, q_norm_w, k_norm_w, cos, sin, heads: int, kv_heads: int,
              head_dim: int, eps: float, gemm: str = "cublas", k_slot=None, v_slot=None, fold_q: bool = False,
              carry=None):
    """GenBlock up to attention: AdaLN modulation, q/k/v projections (w_qkv: (wq, wk, wv) or fused [wq; wk; wv]),
    q/k norms, rotary. modulation None: tmod already holds this block's modulation (denoise precomputes it for
    every step and block). Pure function of its tensors (weights passed in), so one torch.compile serves every
    block (see GenBlock.compiled). k_slot/v_slot (inference): heads_slots views of the K/V buffers' scratch slots,
    written here, no other slot touched (compiled, Inductor stores K and V there itself: on the CPU inside the
    kernel that computes them, on an H200 in one kernel of its own per block, ~3.5 us at batch 64, where two ATen
    copies ran before); k and v are then returned as None.
    fold_q (kv_layout=folded): q is returned folded (fold_queries), normed and rotated in that layout (see
    _folded_queries), so that compiled, the kernel that computes q stores it there: no copy before attention.
    carry (d, g2): the previous block's MLP output and gate, its residual not yet added (_block_out's defer): x + g2
    * d is computed here, where compiled it shares a kernel with the norm that reads it, and is returned last."""
    x = add_carry(x, carry)
    q, k, v, g1, sh2, sc2, g2 = _block_in_qkv(x, tmod, modulation, w_qkv, q_norm_w, k_norm_w, cos, sin, heads,
                                              kv_heads, head_dim, eps, gemm, fold_q)
    if k_slot is not None:
        k_slot.copy_(k[:, :, None])
        v_slot.copy_(v[:, :, None])
        k = v = None
    if carry is not None:
        return q, k, v, g1, sh2, sc2, g2, x
    return q, k, v, g1, sh2, sc2, g2


def _folded_queries(q: torch.Tensor, q_norm_w, cos, sin, kv_heads: int, head_dim: int, eps: float) -> torch.Tensor:
    """q (B, n, heads * hd), a projection's output -> normed, rotated and folded (B, kv_heads, heads // kv_heads *
    n, hd) (fold_queries' layout). The norm and the rotation run on the (B, kv_heads, group, n, hd) view, so their
    result, contiguous in that shape, is the folded layout itself: compiled, the kernel that norms q writes it
    where attention reads it. (q sliced from one tensor normed with k, as the unfolded path does, can be folded
    only by a copy: its batch stride counts k's heads too.)"""
    b, n, _ = q.shape
    q = q.view(b, n, kv_heads, -1, head_dim).permute(0, 2, 3, 1, 4)
    q = _rope(F.rms_norm(q, (head_dim,), q_norm_w, eps), cos, sin)
    return q.reshape(b, kv_heads, -1, head_dim)


def _block_in_qkv(x, tmod, modulation, w_qkv, q_norm_w, k_norm_w, cos, sin, heads: int, kv_heads: int,
                  head_dim: int, eps: float, gemm: str, fold_q: bool = False):
    b, n, hidden = x.shape
    mod = tmod if modulation is None else tmod + modulation.to(tmod.dtype)
    sh1, sc1, g1, sh2, sc2, g2 = mod.unbind(1)  # each (B, hidden)
    h = F.rms_norm(x, (hidden,), eps=eps) * (1 + sc1[:, None]) + sh1[:, None]
    if isinstance(w_qkv, torch.Tensor) and not fold_q:
        # fused weights (inference): q and k normed and rotated as one tensor of heads + kv_heads heads, each head
        # with its own norm's weight (one kernel instead of two when compiled); v stays a view of the GEMM output
        qkv = _linear(h, w_qkv, gemm)
        nqk = heads + kv_heads
        qk = qkv[..., :nqk * head_dim].view(b, n, nqk, head_dim)
        w_qk = torch.cat([q_norm_w.expand(heads, head_dim), k_norm_w.expand(kv_heads, head_dim)])
        qk = _rope((F.rms_norm(qk, (head_dim,), eps=eps) * w_qk).transpose(1, 2), cos, sin)
        v = qkv[..., nqk * head_dim:].view(b, n, kv_heads, head_dim).transpose(1, 2)
        return qk[:, :heads], qk[:, heads:], v, g1, sh2, sc2, g2
    # one projection each (the training weights), or fold_q: q normed apart from k, in the folded layout
    q, k, v = _project(h, w_qkv, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), gemm)
    if fold_q:
        q = _folded_queries(q, q_norm_w, cos, sin, kv_heads, head_dim, eps)
    else:
        q = _rope(F.rms_norm(q.view(b, n, heads, head_dim), (head_dim,), q_norm_w, eps).transpose(1, 2), cos, sin)
    k = F.rms_norm(k.view(b, n, kv_heads, head_dim), (head_dim,), k_norm_w, eps).transpose(1, 2)
    v = v.view(b, n, kv_heads, head_dim).transpose(1, 2)
    return q, _rope(k, cos, sin), v, g1, sh2, sc2, g2


def _block_out(x, a, g1, sh2, sc2, g2, wo, w_gu, wd, eps: float, gemm: str = "cublas", defer: bool = False):
    """GenBlock after attention: output projection + gate, AdaLN-modulated SwiGLU MLP + gate (w_gu: (wg, wu) or
    fused [wg; wu]). defer: return (x, MLP output) with the MLP's gated residual not added: the next block's
    _block_in adds it (its carry), in the kernel of its first norm."""
    b, n, hidden = x.shape
    x = x + g1[:, None] * _linear(a.transpose(1, 2).reshape(b, n, -1), wo, gemm)
    h = F.rms_norm(x, (hidden,), eps=eps) * (1 + sc2[:, None]) + sh2[:, None]
    if isinstance(w_gu, torch.Tensor) and _skinny.applies(h, gemm) and not defer:
        # gemm=triton, fused weights: SwiGLU, down projection and gated residual in one skinny kernel
        return _skinny.skinny_swiglu_down(_linear(h, w_gu, gemm), wd, x, g2)
    g, u = _project(h, w_gu, (wd.shape[1], wd.shape[1]), gemm)
    d = _linear(F.silu(g) * u, wd, gemm)
    return (x, d) if defer else x + g2[:, None] * d


_COMPILED: dict[tuple[str, str | None], object] = {}
AUTOTUNE_MODE = "max-autotune-no-cudagraphs"   # gemm=autotune: Inductor benchmarks its Triton GEMM templates vs cuBLAS


def _compiled(name: str, mode: str | None = None):
    """torch.compile'd _block_in / _block_out (built on first use, shared by every block), in Inductor `mode`."""
    fn = _COMPILED.get((name, mode))
    if fn is None:
        fn = _COMPILED[(name, mode)] = torch.compile({"in": _block_in, "out": _block_out}[name], fullgraph=True,
                                                     mode=mode)
    return fn


class GenBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.norm1 = nn.RMSNorm(hidden, eps=eps, elementwise_affine=False)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=eps)
        self.norm2 = nn.RMSNorm(hidden, eps=eps, elementwise_affine=False)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        # AdaLN-single: this block's learned offsets to the shared time modulation (shift, scale, gate) x 2
        self.modulation = nn.Parameter(torch.zeros(6, hidden))
        # inference speed option (WamRefPolicy compile=true): the code before and after attention runs as one
        # compiled (fused) function each, attention between them. The one before attention writes this step's K/V
        # into the scratch slots itself: it is handed views of just those slots (heads_slots), so Inductor stores K
        # and V there, not an eager copy after it (handed the whole buffer, Inductor would write it all back)
        self.compiled = False
        # which kernels run the GEMMs at inference (WamRefPolicy gemm=): cublas (F.linear) | triton (skinny.py's
        # kernel where rows <= skinny.MAX_ROWS) | autotune (the two functions compiled in Inductor's max-autotune)
        self.gemm = "cublas"
        # inference (kv_layout=folded): grouped-query attention as plain attention with the query heads folded
        # into the query axis (see attend)
        self.fold_gqa = False
        # which kernel runs the loop's folded attention (WamRefPolicy attention=): sdpa | triton (folded_attention.py)
        self.attention = "sdpa"
        # compiled inference: the MLP's residual added by the next block (WamRefPolicy residual_carry=, see defers)
        self.residual_carry = True

    def defers(self, kv_room: bool) -> bool:
        """Whether forward hands its MLP's gated residual to the next block (carry) instead of adding it: compiled
        inference (kv_room) with cuBLAS GEMMs, where the add then shares a kernel with the next block's first norm
        (one read and write of the hidden state less per block: the add was a kernel of its own)."""
        return kv_room and self.compiled and self.gemm == "cublas" and self.residual_carry

    def forward(self, x, tmod, cos, sin, prefix_k, prefix_v, attn_mask, kv_room: bool = False, fused=None,
                own_mod: bool = False, carry=None):
        """kv_room=False (training): prefix_k/v are (B, kv_heads, S, hd) and the action tokens' K/V are concatenated
        to them. kv_room=True (inference, no autograd): prefix_k/v are `Prefix.with_room` buffers (B, heads or
        kv_heads, S + n, hd) whose last n slots this block overwrites with its own K/V. Same values either way.
        fused: None (one GEMM per projection) or this block's (w_qkv, w_gate_up) from fused.FusedWeights.
        own_mod: tmod is this block's modulation already (shared time modulation + self.modulation).
        carry: the previous block's (MLP output, gate) where it deferred its residual (defers): x + gate * output is
        this block's input. Returns x, or where this block defers, (x, its MLP output, its gate) for the next block
        (or GenerationTower.run_blocks after the last) to add."""
        b, n, _ = x.shape
        if self.gemm == "autotune":
            fin, fout = _compiled("in", AUTOTUNE_MODE), _compiled("out", AUTOTUNE_MODE)
        else:
            fin, fout = (_compiled("in"), _compiled("out")) if self.compiled else (_block_in, _block_out)
        w_qkv, w_gu = fused if fused is not None else (
            (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight), (self.gate_proj.weight, self.up_proj.weight))
        # kv_room: this step's K/V go into the scratch slots, in place, written by fin itself
        slots = ((heads_slots(prefix_k, b, self.kv_heads, prefix_k.shape[2] - n, n),
                  heads_slots(prefix_v, b, self.kv_heads, prefix_v.shape[2] - n, n)) if kv_room else (None, None))
        # folded attention over the kv-room buffers: fin returns q folded already (see _block_in)
        fold_q = kv_room and self.fold_gqa and prefix_k.shape[1] == self.kv_heads < self.heads
        outs = fin(x, tmod, None if own_mod else self.modulation, w_qkv, self.q_norm.weight, self.k_norm.weight,
                   cos, sin, self.heads, self.kv_heads, self.head_dim, self.eps, self.gemm, *slots, fold_q=fold_q,
                   carry=carry)
        q, k, v, g1, sh2, sc2, g2 = outs[:7]
        if carry is not None:
            x = outs[7]
        if kv_room:
            k, v = prefix_k, prefix_v
        else:
            k = torch.cat([prefix_k.to(k.dtype), k], dim=2)
            v = torch.cat([prefix_v.to(v.dtype), v], dim=2)
        a = (attend_folded(q, k, v, attn_mask, self.heads, self.attention) if fold_q
             else attend(q, k, v, attn_mask, self.fold_gqa))
        if self.defers(kv_room):
            x, d = fout(x, a, g1, sh2, sc2, g2, self.o_proj.weight, w_gu, self.down_proj.weight, self.eps, self.gemm,
                        defer=True)
            return x, d, g2
        return fout(x, a, g1, sh2, sc2, g2, self.o_proj.weight, w_gu, self.down_proj.weight, self.eps, self.gemm)


class GenerationTower(nn.Module):
    def __init__(self, text_config, hidden: int, ffn: int, action_dim: int, state_dim: int = 0,
                 time_freq_dim: int = 256):
        super().__init__()
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

        heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
        head_dim = head_dim_of(text_config)
        eps = text_config.rms_norm_eps
        self.hidden, self.action_dim, self.state_dim, self.time_freq_dim = hidden, action_dim, state_dim, time_freq_dim
        self.action_in = nn.Linear(action_dim, hidden)
        self.state_in = nn.Linear(state_dim, hidden) if state_dim > 0 else None
        self.time_mlp = nn.Sequential(nn.Linear(time_freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.time_mod = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.blocks = nn.ModuleList([GenBlock(hidden, ffn, heads, kv_heads, head_dim, eps)
                                     for _ in range(text_config.num_hidden_layers)])
        self.norm_out = nn.RMSNorm(hidden, eps=eps, elementwise_affine=False)
        self.out_mod = nn.Linear(hidden, 2 * hidden)
        self.action_out = nn.Linear(hidden, action_dim)
        # the understanding tower's rotary embedding (mRoPE sections), owned here too (buffers only, no weights)
        self.rotary = Qwen3VLTextRotaryEmbedding(text_config)

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        half = self.time_freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = (t.float() * 1000.0)[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def conditioning(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Time conditioning for rows t (R,): the blocks' shared modulation (R, 6, hidden) and the output
        modulation (R, 2 * hidden)."""
        dtype = self.action_in.weight.dtype
        c = self.time_mlp(self.time_embedding(t).to(dtype))
        return self.time_mod(c).view(-1, 6, self.hidden), self.out_mod(F.silu(c))

    def state_token(self, state: torch.Tensor | None, b: int, horizon: int) -> torch.Tensor | None:
        if self.state_in is None:
            return None
        if state is None:
            raise ValueError("this model was built with state_dim > 0: pass state")
        # projected over `horizon` copies so that the GEMM has B * horizon rows (see forward: batch invariance)
        return self.state_in(state.to(self.action_in.weight.dtype)[:, None].expand(-1, horizon, -1))[:, :1]

    def rope(self, prefix: Prefix, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, n, hd) of the n generation tokens: text-style mRoPE positions continuing after the prefix."""
        pos = prefix.next_pos[:, None] + torch.arange(n, device=like.device)[None]  # (B, n)
        return self.rotary(like, pos[None].expand(3, -1, -1))

    def run_blocks(self, tok, tmod, out_mod, cos, sin, prefix: Prefix, attn_mask, kv_room: bool, horizon: int,
                   fused=None):
        """tmod: the shared time modulation (B, 6, hidden), or a list of each block's own (see denoise)."""
        h, carry = tok, None
        own = isinstance(tmod, list)
        for i, blk in enumerate(self.blocks):
            h, carry = split_carry(blk(h, tmod[i] if own else tmod, cos, sin, prefix.keys[i], prefix.values[i],
                                       attn_mask, kv_room, None if fused is None else fused[i], own, carry))
        h = add_carry(h, carry)
        shift, scale = out_mod.chunk(2, dim=-1)
        h = self.norm_out(h) * (1 + scale[:, None]) + shift[:, None]
        return self.action_out(h)[:, h.shape[1] - horizon:]

    def forward(self, prefix: Prefix, x_t: torch.Tensor, t: torch.Tensor, state: torch.Tensor | None = None):
        """Velocity (B, H, action_dim) for noisy actions x_t at times t (B,), attending to the prefix K/V (the
        training path: the prefix K/V is concatenated with the action tokens' in every block; sampling goes through
        `denoise`)."""
        dtype = self.action_in.weight.dtype
        b, horizon, _ = x_t.shape
        # Batch invariance: CPU GEMMs pick kernels by row count, and for a handful of rows (< ~8) a row's result
        # depends on how many rows share the call. So the state is projected over `horizon` copies (rows =
        # B * horizon, like the action tokens); `denoise` computes the time conditioning over the steps, not the rows.
        tok = self.action_in(x_t.to(dtype))
        st = self.state_token(state, b, horizon)
        if st is not None:
            tok = torch.cat([st, tok], dim=1)
        n = tok.shape[1]
        tmod, out_mod = self.conditioning(t)
        cos, sin = self.rope(prefix, n, tok)
        mask = torch.cat([prefix.key_mask, torch.ones(b, n, dtype=torch.bool, device=tok.device)], dim=1)
        return self.run_blocks(tok, tmod, out_mod, cos, sin, prefix, mask[:, None, None, :], False, horizon)

    def denoise(self, prefix: Prefix, x: torch.Tensor, state: torch.Tensor | None, steps: int,
                fused=None) -> torch.Tensor:
        """The whole Euler sampler (t: 0 -> 1 in `steps` steps) from noise x (B, H, action_dim) float32, with the
        prefix in the `Prefix.with_room` layout. What does not change between steps is computed once: the time
        conditioning of every step (one GEMM over `steps` rows, shared by all observations) and of every block at
        every step (one add: shared modulation + each block's table), the state token, the rotary tables and the
        attention mask (additive, in the weights' dtype: see additive_mask); the loop itself only launches device
        work (no host reads, no tensors built from Python values). Returns the final x (float32); no host
        synchronisation inside, so it can be captured in a CUDA graph. fused: per-block fused weights
        (fused.FusedWeights.gen) or None."""
        dtype = self.action_in.weight.dtype
        b, horizon, _ = x.shape
        # k / steps rounded once to float32 (as a Python float cast would be); a device op, not a host copy,
        # so that it can be captured in a CUDA graph
        t_all = (torch.arange(steps, device=x.device, dtype=torch.float64) / steps).float()
        tmods, outs = self.conditioning(t_all)                        # (steps, 6, hidden), (steps, 2 * hidden)
        st = self.state_token(state, b, horizon)
        n = horizon + (0 if st is None else 1)
        cos, sin = self.rope(prefix, n, x.to(dtype))
        attn_mask = additive_mask(prefix.key_mask, dtype)
        # every block's modulation at every step in one op (steps, blocks, 6, hidden); the loop takes views
        mods = torch.stack([blk.modulation for blk in self.blocks]).to(tmods.dtype)
        block_mods = tmods[:, None] + mods[None]
        per_step = [([block_mods[k, i][None].expand(b, -1, -1) for i in range(len(self.blocks))],
                     outs[k:k + 1].expand(b, -1)) for k in range(steps)]
        for tmod, out_mod in per_step:
            tok = self.action_in(x.to(dtype))
            if st is not None:
                tok = torch.cat([st, tok], dim=1)
            v = self.run_blocks(tok, tmod, out_mod, cos, sin, prefix, attn_mask, True, horizon, fused)
            x = x + v.float() / steps
        return x


class WamRefModel(nn.Module):
    """Both towers in one module (the `module` the trainer wraps). `forward` computes the flow-matching loss so
    that an FSDP root wrapped around this module sees every call."""

    def __init__(self, und, gen: GenerationTower):
        super().__init__()
        self.und = und      # transformers Qwen3VLModel
        self.gen = gen
        self.image_slots: list[tuple[int, int]] | None = None   # set_static_layout
        self._geometry: dict[tuple, dict] = {}
        self._slot_index: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ the static prompt layout (training)
    def set_static_layout(self, image_slots: list[tuple[int, int]]) -> bool:
        """Every prompt holds its image tokens at `image_slots` ((start, length) per camera, all lengths equal): then
        the training forward runs the understanding tower without host synchronisation (`encode_prefix_static`).
        False (and the transformers forward stays) when this transformers' text model has no DeepStack hook."""
        lm = self.und.language_model
        if not callable(getattr(type(lm), "_deepstack_process", None)) or len({n for _, n in image_slots}) != 1:
            return False
        self.image_slots = [(int(a), int(n)) for a, n in image_slots]
        lm._deepstack_process = _deepstack_process.__get__(lm)   # this instance only
        return True

    def slot_index(self, device) -> torch.Tensor:
        """The prompt positions of the image tokens (camera after camera), a long tensor on `device` (cached)."""
        key = str(device)
        idx = self._slot_index.get(key)
        if idx is None:
            idx = torch.cat([torch.arange(a, a + n) for a, n in self.image_slots]).to(device)
            self._slot_index[key] = idx
        return idx

    def vision_geometry(self, n_images: int, grid: tuple[int, int, int], device) -> dict:
        """The vision tower's precomputed kwargs for n_images images of grid (t, h, w) patches (cached per count):
        host work done once instead of per call (see `vision_geometry`)."""
        key = (int(n_images), tuple(grid), str(device))
        geo = self._geometry.get(key)
        if geo is None:
            geo = self._geometry[key] = vision_geometry(self.und.visual, n_images, grid, device)
        return geo

    def static_vision_kwargs(self, batch_size: int, device) -> dict:
        """`vision_geometry` for a batch of `batch_size` prompts in the static layout (square images)."""
        merge = self.und.visual.config.spatial_merge_size
        tokens = self.image_slots[0][1]
        side = int(round((tokens * merge * merge) ** 0.5))
        return self.vision_geometry(batch_size * len(self.image_slots), (1, side, side), device)

    def _und_trainable(self) -> bool:
        return any(p.requires_grad for p in self.und.parameters())

    def encode_prefix(self, input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw,
                      position_ids=None) -> Prefix:
        """One understanding-tower pass over the whole batch; returns its per-layer K/V (the 'prefix cache').

        position_ids (3, B, S): the mRoPE positions when the caller has them (the policy computes them on the host
        from a cached template); otherwise transformers' get_rope_index, which loops over the batch in Python and
        reads the mask back from the device."""
        grad = torch.is_grad_enabled() and self._und_trainable()
        with torch.set_grad_enabled(grad):
            if position_ids is None:
                position_ids, _ = self.und.get_rope_index(input_ids, mm_token_type_ids,
                                                          image_grid_thw=image_grid_thw, attention_mask=attention_mask)
            out = self.und(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                           mm_token_type_ids=mm_token_type_ids, use_cache=True)
        return _prefix_from(out, attention_mask, position_ids)

    def velocity(self, prefix: Prefix, x_t, t, state=None):
        return self.gen(prefix, x_t, t, state)

    def encode_prefix_static(self, input_ids, attention_mask, pixel_values, position_ids) -> Prefix:
        """`encode_prefix` for prompts in the static layout (`set_static_layout`), with the same arithmetic and no
        host synchronisation, so that it runs (and back-propagates) without stalling the host on the GPU:
        transformers' forward reads the image count back (`tolist` of the grid, the placeholder-mask check),
        computes the vision geometry on every call and places image and DeepStack features through boolean masks
        (nonzero); here the geometry is computed once per batch size (`static_vision_kwargs`, cached: call it
        before a compiled forward so that the trace finds it) and the features go to the fixed slots by index. The
        decoder layers run through transformers' text model as they are (FSDP's per-layer hooks fire; its cache
        holds the K/V). The geometry is looked up here rather than passed in: FSDP's root would cast its float
        interpolation weights to the parameters' dtype."""
        grad = torch.is_grad_enabled() and self._und_trainable()
        with torch.set_grad_enabled(grad):
            vis = self.und.visual
            b = input_ids.shape[0]
            vision_kwargs = self.static_vision_kwargs(b, input_ids.device)
            idx = self.slot_index(input_ids.device)
            out = vis(pixel_values.to(vis.dtype), grid_thw=vision_kwargs["grid_thw"],
                      **{k: v for k, v in vision_kwargs.items() if k != "grid_thw"})
            lm = self.und.language_model
            h = lm.embed_tokens(input_ids)
            h = h.index_copy(1, idx, out.pooler_output.view(b, idx.numel(), -1).to(h.dtype))
            deep = [f.view(b, idx.numel(), -1) for f in out.deepstack_features]
            out = lm(inputs_embeds=h, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                     visual_pos_masks=idx, deepstack_visual_embeds=deep)
        return _prefix_from(out, attention_mask, position_ids)

    def forward(self, input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw, actions,
                action_mask, noise, t, state=None, position_ids=None, static_prefix: bool = False):
        """Per-sample flow-matching loss (B,) (masked mean over valid timesteps and channels). static_prefix: the
        prompts are in the static layout (set_static_layout) and the prefix is computed without host syncs
        (`encode_prefix_static`); else through transformers' forward."""
        if static_prefix and self.image_slots is not None and position_ids is not None:
            prefix = self.encode_prefix_static(input_ids, attention_mask, pixel_values, position_ids)
        else:
            prefix = self.encode_prefix(input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw,
                                        position_ids)
        tt = t.to(actions.dtype)[:, None, None]
        x_t = (1 - tt) * noise + tt * actions
        target = actions - noise
        v = self.gen(prefix, x_t, t, state).float()
        err = (v - target.float()).pow(2).mean(-1)  # (B, H)
        m = action_mask.float()
        return (err * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def _prefix_from(out, attention_mask, position_ids) -> Prefix:
    """The Prefix of a transformers forward with use_cache=True: its cache's per-layer K/V."""
    # transformers >= 5.2x names the cache `cache`; earlier 5.x releases (e.g. 5.17 on the GPU image) name it
    # `past_key_values`, and older Cache classes keep key_cache/value_cache lists instead of `layers`
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = out.past_key_values
    if hasattr(cache, "layers"):
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
    else:
        keys, values = list(cache.key_cache), list(cache.value_cache)
    valid = attention_mask.bool()
    next_pos = position_ids.masked_fill(~valid[None], -1).amax(dim=(0, 2)) + 1
    return Prefix(keys=keys, values=values, key_mask=valid, next_pos=next_pos)


def _deepstack_process(self, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor,
                       visual_embeds: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3-VL DeepStack step (add visual features to the image tokens' hidden states), installed on
    a text model by WamRefModel.set_static_layout: a boolean mask goes through transformers' own method; a long
    tensor of prompt positions (shared by every prompt; visual_embeds (B, positions, hidden)) adds by index, with no
    host sync (a boolean mask costs a nonzero per layer, forward and backward)."""
    if visual_pos_masks.dtype == torch.bool:
        return type(self)._deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds)
    return hidden_states.index_add(1, visual_pos_masks, visual_embeds.to(hidden_states.dtype))


def vision_geometry(visual, n_images: int, grid: tuple[int, int, int], device) -> dict:
    """The vision tower's precomputed kwargs for n_images images of grid (t, h, w) patches: patch position ids,
    position-embedding interpolation taps and attention boundaries depend only on the image count when all images
    share one size; transformers computes them per call, with host syncs, unless they are passed in
    (`transformers.vision_utils` hooks). cu_seqlens stays on the host: only its length and the Python-int max_seqlen
    are read."""
    from transformers import vision_utils as vu

    thw = torch.tensor([list(grid)] * n_images, dtype=torch.long)
    idx, w = vu.get_vision_interpolation_indices_and_weights(
        thw.to(device), num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size)
    return {"interp_indices": idx, "interp_weights": w,
            "position_ids": vu.get_vision_position_ids(thw.to(device), visual.spatial_merge_size),
            "cu_seqlens": vu.get_vision_cu_seqlens(thw),          # host tensor: read for its length only
            "max_seqlen": int(grid[0] * grid[1] * grid[2]),
            "grid_thw": thw}                                       # host tensor: its values are never read


VISION_ATTENTION = "wamkit_flash_equal_length"  # "flash" in the name routes transformers to its packed-sequence call


def vision_attention_equal_length(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                                  cu_seq_lens_q=None, max_length_q=None, is_causal=False, **_):
    """The understanding tower's vision attention over all images at once.

    transformers' Qwen3-VL vision attention packs every image of the batch into one sequence (1, heads, total, hd)
    with boundaries `cu_seq_lens_q`; for non-flash implementations it splits it and calls attention once per image
    (thousands of small calls per batch, a host sync per layer). Our images all have the same size, so the packed
    sequence reshapes to (images, heads, len, hd) and one SDPA call does the same arithmetic. Unequal lengths fall
    back to one call per image. Returns (1, total, heads, hd), as transformers' attention functions do."""
    _, heads, total, hd = query.shape
    n = int(cu_seq_lens_q.numel()) - 1 if cu_seq_lens_q is not None else 1
    if n >= 1 and max_length_q is not None and int(max_length_q) * n == total:
        length = total // n

        def split(t):
            return t[0].view(heads, n, length, hd).transpose(0, 1)

        out = F.scaled_dot_product_attention(split(query), split(key), split(value), dropout_p=dropout,
                                             is_causal=is_causal, scale=scaling)       # (n, heads, len, hd)
        return out.transpose(1, 2).reshape(1, total, heads, hd), None
    bounds = cu_seq_lens_q.tolist()
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                           is_causal=is_causal, scale=scaling).transpose(1, 2)
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1), None


def use_batched_vision_attention(und) -> None:
    """Route `und`'s vision attention through vision_attention_equal_length (registered with transformers'
    AttentionInterface; the text tower keeps its own implementation)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_ATTENTION, vision_attention_equal_length)
    und.visual.config._attn_implementation = VISION_ATTENTION


def _filler(round_to: torch.dtype | None):
    """fill(tensor, init_fn): init_fn applied in place; for a sharded parameter (a DTensor, after `fully_shard`)
    init_fn fills the full tensor on this rank's device and this rank keeps its shard. Every rank draws the same
    random numbers in the same order as an unsharded init does, so a sharded init gives the unsharded weights
    bit for bit, holding one full tensor at a time. round_to: round each full tensor through this dtype (what a
    build in that dtype followed by `.float()` gives)."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, distribute_tensor
    else:  # a torch without distributed: nothing is sharded
        DTensor = distribute_tensor = None

    def fill(t: torch.Tensor, fn) -> None:
        if DTensor is None or not isinstance(t, DTensor):
            fn(t)
            return
        full = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
        fn(full)
        if round_to is not None and round_to != full.dtype:
            full = full.to(round_to).to(t.dtype)
        t.to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local())

    return fill


@torch.no_grad()
def init_weights(module: nn.Module, std: float = 0.02, round_to: torch.dtype | None = None) -> None:
    """Deterministic init for every parameter and recomputed non-persistent buffers (works after `to_empty`, and
    on parameters sharded by FSDP2: see _filler). Draws from torch's global RNG: seed it first."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (Qwen3VLTextRotaryEmbedding,
                                                                Qwen3VLVisionRotaryEmbedding)

    fill = _filler(round_to)
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv3d, nn.Conv2d)):
            fill(m.weight, lambda t: nn.init.normal_(t, 0.0, std))
            if m.bias is not None:
                fill(m.bias, nn.init.zeros_)
        elif isinstance(m, nn.Embedding):
            fill(m.weight, lambda t: nn.init.normal_(t, 0.0, std))
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            if getattr(m, "weight", None) is not None:
                fill(m.weight, nn.init.ones_)
            if getattr(m, "bias", None) is not None:
                fill(m.bias, nn.init.zeros_)
        elif type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor):
            fill(m.weight, nn.init.ones_)
        if isinstance(m, GenBlock):
            fill(m.modulation, lambda t: nn.init.normal_(t, 0.0, t.shape[-1] ** -0.5))
        if isinstance(m, GenerationTower):
            fill(m.time_mod[1].weight, nn.init.zeros_)  # modulation starts at the per-block tables
            fill(m.out_mod.weight, nn.init.zeros_)
        if isinstance(m, (Qwen3VLTextRotaryEmbedding, Qwen3VLVisionRotaryEmbedding)):
            fresh = type(m)(m.config)  # plain CPU recompute of inv_freq
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(m, name).copy_((buf if round_to is None else buf.to(round_to)).to(getattr(m, name).device))
