"""Skinny GEMMs for the denoising loop: y = x @ w.T for few rows (M <= 64: the action tokens of a small batch) and a
big weight (N x K, as nn.Linear stores it), where the time is reading w once from memory.

A Triton kernel in "swap-AB" form: each program computes a (BLOCK_N x BLOCK_M) tile of y.T = w @ x.T, so the weight
rows fill the MMA's large dimension and the few tokens its small one (what cuBLAS's skinny kernels do), over one
slice of K (split-K: K / SPLIT_K per program). With SPLIT_K > 1 every program writes an fp32 partial sum and a
second kernel adds the SPLIT_K partials in a fixed order and rounds once to the output dtype (deterministic: the same
bits every call, no atomics, no zero-fill); SPLIT_K = 1 writes the output directly.

Which tile / split runs for a shape is a `SkinnyConfig`: `tune()` times a few candidates over the real weights of
every layer (cycling through all of them, so the weights come from memory as in the loop, not from L2) and keeps
the fastest per (row block, N, K); untuned shapes use `heuristic_config`.

`skinny_swiglu_down` (op `wamkit::skinny_swiglu_down`) is the same kernel with a SwiGLU prologue (its input is
silu(g) * u of the gate/up GEMM's output, computed while loading) and a gated-residual epilogue (x + g2 * y, in the
kernel or in the split-K sum): a generation block's tail in one kernel instead of three.

`linear(x, w, gemm)` is the model's GEMM entry point: gemm="triton" and a usable kernel (Triton imports, x on a CUDA
device or TRITON_INTERPRET=1, rows <= MAX_ROWS) run the kernel through the custom op `wamkit::skinny_linear` (opaque
to torch.compile, capturable in CUDA graphs); anything else is F.linear (cuBLAS on GPUs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_ROWS = 64          # the kernel's largest row count (BLOCK_M is the next power of two >= 16 of M)
GEMM_CHOICES = ("cublas", "triton", "autotune")

try:   # Triton is optional: it ships with CUDA builds of torch, not with CPU ones
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "no kernel"
    triton = tl = None


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"   # read once, as triton.jit does when the kernels are defined


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1 before this module was imported)."""
    return _INTERPRET


def available() -> tuple[bool, str]:
    """(whether the Triton kernel can run here at all, why not)."""
    if triton is None:
        return False, "triton does not import"
    if not (torch.cuda.is_available() or interpreting()):
        return False, "no CUDA device and TRITON_INTERPRET is not 1"
    return True, ""


def block_m(m: int) -> int:
    return max(16, 1 << (max(m, 1) - 1).bit_length())


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 128
    block_k: int = 128
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4

    def fits(self, n: int, k: int, bm: int) -> bool:
        """Whether this config tiles (N, K) exactly and its pipeline fits in shared memory (~200 KiB)."""
        smem = self.num_stages * (self.block_n + bm) * self.block_k * 2
        return n % self.block_n == 0 and k % (self.block_k * self.split_k) == 0 and smem <= 200 * 1024


def heuristic_config(m: int, n: int, k: int, sms: int = 132) -> SkinnyConfig:
    """A config without measurement: 128-row weight tiles, split K until there are >= 2 programs per SM (at least
    4 K iterations per program)."""
    bm = block_m(m)
    bn = 128 if n % 128 == 0 else 64 if n % 64 == 0 else 32 if n % 32 == 0 else 16
    bk = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32 if k % 32 == 0 else 16
    split = 1
    while (n // bn) * split < 2 * sms and k % (bk * split * 2) == 0 and k // (bk * split * 2) >= 4:
        split *= 2
    stages = 4 if bm <= 32 else 3
    return SkinnyConfig(bn, bk, split, 4, stages)


TILES = ((128, 128, 4, 4), (64, 128, 4, 5), (64, 256, 4, 4), (128, 64, 4, 6), (256, 64, 8, 4))
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) that candidate_configs combines with K splits."""


def candidate_configs(m: int, n: int, k: int, sms: int = 132) -> list[SkinnyConfig]:
    """The configs `tune` tries for one shape: the heuristic one, then for each tile of TILES the two smallest
    power-of-two K splits that give every SM at least one program (as many as fit in its shared memory), and the
    128 x 128 tile unsplit. Compiles depend on the tile and on split or not, not on the split count."""
    bm = block_m(m)
    out = [heuristic_config(m, n, k, sms)]
    for bn, bk, warps, stages in TILES:
        smem = stages * (bn + bm) * bk * 2
        per_sm = max(1, (220 * 1024) // smem)
        split = 1
        while (n // bn) * split < sms * per_sm and k // (bk * split * 2) >= 2:
            split *= 2
        for sp in (split, split * 2) + ((1,) if (bn, bk) == (128, 128) else ()):
            c = SkinnyConfig(bn, bk, sp, warps, stages)
            if c.fits(n, k, bm) and c not in out:
                out.append(c)
    return out


_TUNED: dict[tuple[int, int, int], SkinnyConfig] = {}   # (BLOCK_M, N, K) -> the fastest config measured


def config_for(m: int, n: int, k: int) -> SkinnyConfig:
    return _TUNED.get((block_m(m), n, k)) or heuristic_config(m, n, k)


def set_config(m: int, n: int, k: int, cfg: SkinnyConfig) -> None:
    _TUNED[(block_m(m), n, k)] = cfg


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, part_ptr, res_ptr, gate_ptr, M, N, K, k_per_split, stride_xm,
                       stride_wn, stride_ym, stride_rm, stride_gb, tokens,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PARTIAL: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr, SWIGLU: tl.constexpr,
                       RESIDUAL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        k0 = pid_k * k_per_split
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :]     # (BLOCK_N, BLOCK_K), K contiguous
        x_ptrs = x_ptr + rm[None, :] * stride_xm + (k0 + rk)[:, None]     # (BLOCK_K, BLOCK_M): x.T
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kk in range(0, k_per_split, BLOCK_K):
            if EVEN:
                w = tl.load(w_ptrs)
                xmask = (rm < M)[None, :]
            else:
                kmask = (k0 + kk + rk) < K
                w = tl.load(w_ptrs, mask=(rn < N)[:, None] & kmask[None, :], other=0.0)
                xmask = (rm < M)[None, :] & kmask[:, None]
            if SWIGLU:   # x = [g, u] (M, 2K): the GEMM's input is silu(g) * u, rounded once to the weights' dtype
                g = tl.load(x_ptrs, mask=xmask, other=0.0).to(tl.float32)
                u = tl.load(x_ptrs + K, mask=xmask, other=0.0).to(tl.float32)
                x = (g * tl.sigmoid(g) * u).to(w.dtype)
            else:
                x = tl.load(x_ptrs, mask=xmask, other=0.0)
            if IEEE:
                acc += tl.dot(w, x, input_precision="ieee")
            else:
                acc += tl.dot(w, x)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        omask = (rm < M)[None, :] & (rn < N)[:, None]
        if not PARTIAL:
            if RESIDUAL:   # y = residual + gate[row // tokens] * (x @ w.T)
                r = tl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=omask, other=0.0)
                gt = tl.load(gate_ptr + (rm // tokens)[None, :] * stride_gb + rn[:, None], mask=omask, other=0.0)
                acc = r.to(tl.float32) + gt.to(tl.float32) * acc
            tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=omask)
        else:   # partials (splits, M, N) fp32
            tl.store(part_ptr + pid_k * M * N + rm[None, :] * N + rn[:, None], acc, mask=omask)

    @triton.jit
    def _sum_splits_kernel(part_ptr, y_ptr, res_ptr, gate_ptr, MN, N, stride_ym, stride_rm, stride_gb, tokens,
                           splits, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in range(1, splits):
            acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
        row = offs // N
        col = offs - row * N
        if RESIDUAL:
            r = tl.load(res_ptr + row * stride_rm + col, mask=mask, other=0.0)
            gt = tl.load(gate_ptr + (row // tokens) * stride_gb + col, mask=mask, other=0.0)
            acc = r.to(tl.float32) + gt.to(tl.float32) * acc
        tl.store(y_ptr + row * stride_ym + col, acc.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig | None = None, *, swiglu: bool = False,
                  residual: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                  tokens: int = 1) -> torch.Tensor:
    """x (M, K) @ w (N, K).T -> (M, N) in x's dtype, through the Triton kernel (see the module docstring).

    swiglu: x is [g, u] (M, 2K) and the GEMM's input is silu(g) * u (computed in the kernel: no separate kernel,
    no intermediate tensor). residual (M, N) and gate (M // tokens, N): the result is residual + gate[row //
    tokens] * (x @ w.T), added in fp32 before the one rounding (the generation block's gated residual)."""
    if triton is None:
        raise RuntimeError("skinny_matmul needs triton")
    m, kx = x.shape
    n, k = w.shape
    if kx != (2 * k if swiglu else k):
        raise ValueError(f"skinny_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (swiglu={swiglu})")
    if m > MAX_ROWS:
        raise ValueError(f"skinny_matmul: {m} rows > {MAX_ROWS}")
    if (residual is None) != (gate is None):
        raise ValueError("skinny_matmul: residual and gate go together")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if residual is not None:
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        gate = gate if gate.stride(1) == 1 else gate.contiguous()
    cfg = cfg or config_for(m, n, k)
    bm = block_m(m)
    split = cfg.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)          # every split gets a non-empty slice
    even = n % cfg.block_n == 0 and k % k_per_split == 0 and k_per_split % cfg.block_k == 0
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    part = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else y
    res, gt = (residual, gate) if residual is not None else (y, y)
    grid = (triton.cdiv(n, cfg.block_n), split)
    _skinny_kernel[grid](x, w, y, part, res, gt, m, n, k, k_per_split, x.stride(0), w.stride(0), y.stride(0),
                         res.stride(0), gt.stride(0), tokens,
                         BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PARTIAL=split > 1, EVEN=even,
                         IEEE=x.dtype == torch.float32, SWIGLU=swiglu, RESIDUAL=residual is not None,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, y, res, gt, m * n, n, y.stride(0), res.stride(0),
                                                          gt.stride(0), tokens, split,
                                                          RESIDUAL=residual is not None, BLOCK=block, num_warps=4)
    return y


@torch.library.custom_op("wamkit::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ w.T through skinny_matmul (the config of `config_for`); an op, so that torch.compile keeps it
    as one opaque call."""
    lead = x.shape[:-1]
    return skinny_matmul(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[0])


@skinny_linear.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("wamkit::skinny_swiglu_down", mutates_args=())
def skinny_swiglu_down(gu: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """residual + gate[:, None] * (silu(g) * u) @ w.T for gu = [g, u] (B, n, 2F), w (H, F), residual (B, n, H),
    gate (B, H): a generation block's SwiGLU down projection and gated residual as one skinny GEMM."""
    b, n, _ = gu.shape
    y = skinny_matmul(gu.reshape(b * n, -1), w, swiglu=True, residual=residual.reshape(b * n, -1), gate=gate,
                      tokens=n)
    return y.reshape(b, n, w.shape[0])


@skinny_swiglu_down.register_fake
def _(gu, w, residual, gate):
    return residual.new_empty(residual.shape)


def applies(x: torch.Tensor, gemm: str) -> bool:
    """Whether gemm="triton" runs the kernel for input x here (Triton, a CUDA tensor or the interpreter, few rows)."""
    return (gemm == "triton" and triton is not None and (x.is_cuda or interpreting())
            and x.numel() // x.shape[-1] <= MAX_ROWS)


def linear(x: torch.Tensor, w: torch.Tensor, gemm: str = "cublas") -> torch.Tensor:
    """The denoising loop's GEMM: F.linear, or with gemm="triton" the skinny kernel where it applies (see the module
    docstring). "autotune" is F.linear here: Inductor's max-autotune replaces it inside the compiled blocks."""
    if applies(x, gemm):
        return skinny_linear(x, w)
    return F.linear(x, w)


def graph_us(fn, reps: int = 5, calls: int = 1) -> list[float]:
    """Device microseconds per call of fn() (which makes `calls` calls), CUDA only: fn warmed up on a side stream,
    captured once in a CUDA graph, the graph replayed `reps` times, each replay timed with CUDA events (so host
    launch overhead is not in the figure, as in the captured denoising loop). Returns every replay's time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / calls)
    del g
    return out


def host_us(fn, reps: int = 5, calls: int = 1) -> list[float]:
    """graph_us's host-clock stand-in off CUDA (Triton's interpreter: tests and smoke runs)."""
    import time

    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6 / calls)
    return out


@torch.no_grad()
def tune(m: int, weights: list[torch.Tensor], reps: int = 5) -> dict:
    """Measure candidate_configs for x (m, K) against every weight in `weights` (one shape: the same weight of every
    layer), each config timed over the whole list in one CUDA graph (weights from memory, not L2, no launch
    overhead; off CUDA by the host clock), median of `reps` replays; the fastest becomes this shape's config
    (`config_for`). Returns {"config": the winner or None, "us": {config: microseconds per GEMM}, "errors":
    {config: why}}."""
    n, k = weights[0].shape
    x = torch.randn(m, k, device=weights[0].device, dtype=weights[0].dtype)
    times: dict[SkinnyConfig, float] = {}
    errors: dict[str, str] = {}
    for cfg in candidate_configs(m, n, k):
        try:
            timer = graph_us if x.is_cuda else host_us
            ts = timer(lambda: [skinny_matmul(x, w, cfg) for w in weights], reps, len(weights))
            times[cfg] = sorted(ts)[len(ts) // 2]
        except Exception as e:  # noqa: BLE001 - a config that does not compile or launch here is not a candidate
            errors[str(cfg)] = f"{type(e).__name__}: {e}"[:300]
    if not times:
        return {"config": None, "us": {}, "errors": errors}
    best = min(times, key=times.get)
    set_config(m, n, k, best)
    return {"config": best, "us": {str(c): t for c, t in times.items()}, "errors": errors}
