"""The denoising loop's folded attention as a Triton kernel (wam-ref `attention=triton`): few query rows per KV head
(the action tokens' query heads folded: model.fold_queries) over the prefix's K/V and the action slots, with the
additive key mask of model.additive_mask, no causal structure.

Why: in the nano-shape loop (batch 64) SDPA's kernel takes ~54 us a block and step where reading its K/V at the
copy rate takes ~24 us; at batch 1 it takes ~12 us for 1.2 MB, on 8 of the GPU's SMs (one program per KV head).

The kernel: program (b * kv_heads + h, split) holds the group's M query rows (BLOCK_M >= M, a power of two >= 16)
and walks its slice of the keys in BLOCK_N blocks with the online softmax (fp32 scores and sums, the probabilities
rounded to the inputs' dtype before the P @ V product, as flash attention does). Where the batch gives fewer
programs than the GPU has SMs, the keys are split (flash-decoding): each split writes fp32 partial sums and its
row maxima and sums, and a second kernel combines the splits in a fixed order (deterministic). Masked keys score
-1e30 (not -inf), so a split whose keys are all masked adds nothing; a row whose every key is masked would average
V instead of SDPA's NaN (the loop never has one: its action slots are always attended).

`available()` / `applies()` say whether it can run (Triton imports, CUDA tensors or TRITON_INTERPRET=1, a
power-of-two head dim); otherwise model.attend_folded runs SDPA. tests/test_folded_attention.py compares it with
SDPA in Triton's CPU interpreter; bench/device/bench_attention.py times it (`--backends triton`).
"""

from __future__ import annotations

import math

import torch

from wamkit.policies.wam_ref.skinny import available, block_m, interpreting, tl, triton

ATTENTION_CHOICES = ("sdpa", "triton")
BLOCK_N = 64
# warps per program: compiled for sm_90 (no GPU needed) at BLOCK_M 64, head dim 128, the kernel takes 255 registers
# a thread with 4 warps (16 bytes spilled; two programs fit an SM) and 241 with 8 (none; one program an SM);
# bench_attention's backend "triton-w8" times the other
NUM_WARPS = 4
COMBINE_ROWS = 16   # query rows per program of the split combine


def applies(q: torch.Tensor, attention: str) -> bool:
    """Whether attention="triton" runs the kernel for folded queries q (B, kv_heads, M, hd) here."""
    hd = q.shape[-1]
    return (attention == "triton" and available()[0] and (q.is_cuda or interpreting())
            and hd >= 16 and hd & (hd - 1) == 0 and q.shape[-2] <= 128)


def splits_for(programs: int, keys: int, sms: int) -> int:
    """Key splits per (batch, kv head): 1 where the programs fill the SMs, else enough to give each SM about one
    program, each split at least one BLOCK_N block of keys."""
    blocks = max(1, math.ceil(keys / BLOCK_N))
    if programs >= sms:
        return 1
    want = min(blocks, math.ceil(sms / programs))
    per = math.ceil(blocks / want)            # key blocks per split
    return math.ceil(blocks / per)


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132   # the interpreter: split as an H100 would


if triton is not None:
    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, part_ptr, stat_ptr, M, N, kv_heads, ntok,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smn, sob, soh, sog, sot, scale,
                     HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, D: tl.constexpr):
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // kv_heads
        h = bh % kv_heads
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        cols0 = tl.arange(0, BLOCK_N)
        q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :], mask=rows[:, None] < M,
                    other=0.0)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        start = sp * PER_SPLIT   # keys per split, a multiple of BLOCK_N: the splits never overlap
        for n0 in range(0, PER_SPLIT, BLOCK_N):
            cols = start + n0 + cols0
            valid = cols < N
            k = tl.load(k_ptr + b * skb + h * skh + cols[:, None] * skn + dims[None, :], mask=valid[:, None],
                        other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            if HAS_MASK:
                add = tl.load(mask_ptr + b * smb + cols * smn, mask=valid, other=-1.0e30).to(tl.float32)
                s = s + tl.maximum(add, -1.0e30)[None, :]
            s = tl.where(valid[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + b * svb + h * svh + cols[:, None] * svn + dims[None, :], mask=valid[:, None],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        keep = rows[:, None] < M
        if SPLIT == 1:
            out = acc / l_i[:, None]
            o_rows = (rows // ntok) * sog + (rows % ntok) * sot
            tl.store(o_ptr + b * sob + h * soh + o_rows[:, None] + dims[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=keep)
        else:
            base = (bh * SPLIT + sp) * BLOCK_M
            tl.store(part_ptr + (base + rows[:, None]) * D + dims[None, :], acc, mask=keep)
            tl.store(stat_ptr + (bh * SPLIT + sp) * 2 * BLOCK_M + rows, m_i, mask=rows < M)
            tl.store(stat_ptr + (bh * SPLIT + sp) * 2 * BLOCK_M + BLOCK_M + rows, l_i, mask=rows < M)

    @triton.jit
    def _combine_kernel(part_ptr, stat_ptr, o_ptr, M, kv_heads, ntok, sob, soh, sog, sot,
                        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // kv_heads
        h = bh % kv_heads
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)   # this program's rows of the group's BLOCK_M
        dims = tl.arange(0, D)
        live = rows < M
        top = tl.full([ROWS], -1.0e30, tl.float32)
        for sp in tl.static_range(SPLIT):
            top = tl.maximum(top, tl.load(stat_ptr + (bh * SPLIT + sp) * 2 * BLOCK_M + rows, mask=live,
                                          other=-1.0e30))
        num = tl.zeros([ROWS, D], tl.float32)
        den = tl.zeros([ROWS], tl.float32)
        for sp in tl.static_range(SPLIT):
            st = (bh * SPLIT + sp) * 2 * BLOCK_M
            w = tl.exp(tl.load(stat_ptr + st + rows, mask=live, other=-1.0e30) - top)
            den += w * tl.load(stat_ptr + st + BLOCK_M + rows, mask=live, other=0.0)
            part = tl.load(part_ptr + ((bh * SPLIT + sp) * BLOCK_M + rows[:, None]) * D + dims[None, :],
                           mask=live[:, None], other=0.0)
            num += part * w[:, None]
        out = num / tl.where(live, den, 1.0)[:, None]
        o_rows = (rows // ntok) * sog + (rows % ntok) * sot
        tl.store(o_ptr + b * sob + h * soh + o_rows[:, None] + dims[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])


def folded_attention(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                     splits: int | None = None, tokens: int | None = None) -> torch.Tensor:
    """softmax(qf @ k^T / sqrt(hd) + mask) @ v for qf (B, Hkv, M, hd), k/v (B, Hkv, N, hd) (the last dim
    contiguous), attn_mask additive (B, 1, 1, N) (or broadcastable to it) or None -> (B, Hkv, M, hd) in qf's dtype.
    splits: key splits per (batch, kv head); None chooses (splits_for).
    tokens (n, M a multiple of it: folded queries, row g * n + t = query head h * M // n + g, token t): the output
    is written token-major instead, (B, n, Hkv * M // n, hd) contiguous, the layout the output projection reads,
    so no transposing copy runs between them."""
    b, kvh, m, hd = qf.shape
    n = k.shape[2]
    if k.shape[:2] != (b, kvh) or v.shape != k.shape or k.shape[-1] != hd:
        raise ValueError(f"folded_attention: q {tuple(qf.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for t in (qf, k, v):
        if t.stride(-1) != 1:
            raise ValueError("folded_attention needs the head dim contiguous")
    if tokens is not None and (tokens < 1 or m % tokens):
        raise ValueError(f"folded_attention: {m} folded query rows are not whole groups of {tokens} tokens")
    bm = block_m(m)
    split = int(splits) if splits else splits_for(b * kvh, n, _sms(qf.device))
    per = math.ceil(math.ceil(n / BLOCK_N) / split) * BLOCK_N
    split = math.ceil(n / per)
    if tokens is None:
        out = torch.empty((b, kvh, m, hd), device=qf.device, dtype=qf.dtype)
        # row r at r * stride(2): one group of M tokens
        layout = (m, out.stride(0), out.stride(1), 0, out.stride(2))
    else:
        group = m // tokens
        out = torch.empty((b, tokens, kvh * group, hd), device=qf.device, dtype=qf.dtype)
        # row g * tokens + t: query head h * group + g, token t
        layout = (tokens, out.stride(0), group * out.stride(2), out.stride(2), out.stride(1))
    if split > 1:
        part = torch.empty((b * kvh * split * bm * hd,), device=qf.device, dtype=torch.float32)
        stat = torch.empty((b * kvh * split * 2 * bm,), device=qf.device, dtype=torch.float32)
    else:
        part = stat = out   # unused
    if attn_mask is not None:
        mask = attn_mask.expand(b, 1, 1, n)
        mask_args = (mask, mask.stride(0), mask.stride(3))
    else:
        mask_args = (out, 0, 0)
    _attn_kernel[(b * kvh, split)](
        qf, k, v, mask_args[0], out, part, stat, m, n, kvh, layout[0],
        qf.stride(0), qf.stride(1), qf.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask_args[1], mask_args[2], *layout[1:], 1.0 / math.sqrt(hd),
        HAS_MASK=attn_mask is not None, SPLIT=split, PER_SPLIT=per, BLOCK_M=bm, BLOCK_N=BLOCK_N, D=hd,
        num_warps=NUM_WARPS, num_stages=2)
    if split > 1:
        # the combine over row tiles too: one program per (batch, kv head) ran on 8 SMs at nano batch 1 (~4 us)
        rows = min(bm, COMBINE_ROWS)
        _combine_kernel[(b * kvh, math.ceil(m / rows))](part, stat, out, m, kvh, *layout, SPLIT=split, BLOCK_M=bm,
                                                        ROWS=rows, D=hd, num_warps=4)
    return out
