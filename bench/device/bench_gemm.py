"""The denoising step's GEMMs and the rest of its work, per kernel candidate, at wam-ref nano-shape (issue #20 item 1).

    python bench/device/bench_gemm.py --out $OUT/gemm.json [--rows 16,1024] [--budget-s 80] [--skip autotune,...]
    # on the H200 (< 90 s):
    PYTHONPATH=$PWD/src timeout -k 5 88 python3 bench/device/bench_gemm.py --out $OUT/gemm.json --budget-s 78
    python bench/device/bench_gemm.py --out /tmp/gemm.json --device cpu --size tiny --rows 16 --reps 3   # smoke

For every distinct (M, K, N) GEMM of one denoising step (fused q/k/v, o, fused gate/up, down; M = rows = batch x 16
action tokens) every candidate is timed the way the captured loop runs it: one CUDA graph that calls it over several
copies of the weight (cycling through >= 256 MB of weights, so they come from HBM and not from the 50 MB L2, as
the 36 layers' weights do), replayed >= 50 times, each replay timed with CUDA events; median per GEMM. Reported as
weight GB/s (weight bytes / time), its fraction of the measured copy bandwidth (bytes read + written / time, as
bench_nano measures it), TFLOP/s and its fraction of the measured bf16 matmul ceiling. Candidates:
  cublas           F.linear, weight as stored (N x K): cuBLAS / cuBLASLt's choice
  cublas_nt        x @ w_t with w_t = w.T made contiguous (K x N): the other layout
  cublaslt         F.linear with torch.backends.cuda.preferred_blas_library("cublaslt")
  cublas_noredprec F.linear with allow_bf16_reduced_precision_reduction=False (other split-K reductions)
  triton           skinny.py's split-K kernel (M <= 64): every candidate config (skinny.tune), the fastest kept
  autotune         torch.compile(F.linear, mode="max-autotune-no-cudagraphs"): Inductor's Triton templates vs
                   cuBLAS (compile seconds and the winner's kind: aten / triton template / decompose_k)
  autotune_tma     the same with inductor triton.enable_persistent_tma_matmul=True (where the knob exists)
Then the non-GEMM work of a step at batch 1, op by op (in graphs, per layer), and whole generation blocks (model.py's
GenBlock at nano-shape width, eager and compiled, gemm=cublas and triton) so that block - GEMMs = the rest.
Every candidate is guarded (a failure is recorded, not fatal); the JSON is rewritten after every section; expensive
candidates are skipped once `--budget-s` would be exceeded (recorded as skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from wamkit.policies.wam_ref import skinny  # noqa: E402
from wamkit.policies.wam_ref.model import (GenBlock, _rope, add_carry, additive_mask, split_carry,  # noqa: E402
                                             write_heads)
from wamkit.policies.wam_ref.sizes import get_size  # noqa: E402

T0 = time.perf_counter()
DEV = torch.device("cuda")


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def cuda() -> bool:
    return DEV.type == "cuda"


def measure_us(fn, calls: int, reps: int) -> list[float]:
    """Microseconds per call of fn() (which makes `calls` calls): CUDA graph replays (skinny.graph_us) on the GPU,
    the host clock on the CPU (smoke runs)."""
    return skinny.graph_us(fn, reps, calls) if cuda() else skinny.host_us(fn, reps, calls)


def med(ts: list[float]) -> float:
    return float(statistics.median(ts))


def ceilings() -> dict:
    """bench_nano's ceilings (one measurement for both benches). This bench timed its 1 GiB copy inside a CUDA
    graph until session 11: captured, a device-to-device copy_ becomes a graph memcpy node, which measured 2.74 TB/s
    on the H200 (session 7) against 4.28 TB/s for bench_nano's copy on a stream, the figure its floors use; so
    this bench's `of_copy_bw` read > 1 for GEMMs that streamed their weights at 3-4 TB/s."""
    if not cuda():
        return {"copy_tb_s": float("nan"), "bf16_matmul_tflops": float("nan")}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_nano import ceilings as nano_ceilings

    return nano_ceilings()


def knobs() -> dict:
    """Which skinny-GEMM related knobs this torch has (name -> value, or None when absent)."""
    out = {"torch": torch.__version__, "triton": getattr(skinny.triton, "__version__", None),
           "skinny_available": skinny.available()[0], "skinny_unavailable_reason": skinny.available()[1]}
    try:
        import torch._inductor.config as ic

        for name in ("max_autotune", "max_autotune_gemm", "max_autotune_gemm_backends",
                     "max_autotune_gemm_search_space", "coordinate_descent_tuning", "decompose_mem_bound_mm",
                     "use_mixed_mm", "shape_padding", "force_shape_pad", "epilogue_fusion", "prologue_fusion",
                     "benchmark_epilogue_fusion", "autotune_in_subproc", "triton.enable_persistent_tma_matmul",
                     "triton.num_decompose_k_splits", "triton.decompose_k_threshold", "triton.enable_pdl",
                     "triton.native_matmul", "triton.cudagraphs", "cuda.cutlass_dir", "nvgemm_max_profiling_configs"):
            obj, ok = ic, True
            for part in name.split("."):
                if not hasattr(obj, part):
                    ok = False
                    break
                obj = getattr(obj, part)
            out[f"inductor.{name}"] = repr(obj) if ok else None
    except Exception as e:  # noqa: BLE001
        out["inductor_error"] = f"{type(e).__name__}: {e}"
    out["preferred_blas_library"] = str(torch.backends.cuda.preferred_blas_library()) \
        if hasattr(torch.backends.cuda, "preferred_blas_library") else None
    out["allow_bf16_reduced_precision_reduction"] = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    return out


def shapes(size: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the denoising step's GEMMs (fused q/k/v and gate/up, as the inference path runs them)."""
    t = get_size(size).text
    hidden, ffn = t["hidden_size"], t["intermediate_size"]
    heads, kvh, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    return {"qkv": ((heads + 2 * kvh) * hd, hidden), "o": (hidden, heads * hd), "gate_up": (2 * ffn, hidden),
            "down": (hidden, ffn)}


class Budget:
    def __init__(self, seconds: float):
        self.end = T0 + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def gemm_candidates(m: int, ws: list[torch.Tensor], args, budget: Budget, compile_cost: dict, phase: str,
                    res: dict, name: str = "") -> dict:
    """Phase "cheap": cuBLAS variants and the Triton kernel; "autotune" / "autotune_tma": that compiled candidate.
    Results go into res (one dict per candidate)."""
    n, k = ws[0].shape
    x = torch.randn(m, k, device=DEV, dtype=ws[0].dtype)
    calls = len(ws)

    def run(name, fn, setup=None, teardown=None, extra=None):
        if name in args.skip:
            res[name] = {"skipped": "--skip"}
            return
        try:
            if setup:
                setup()
            try:
                ts = measure_us(fn, calls, args.reps)
            finally:
                if teardown:
                    teardown()
            res[name] = {"us": med(ts), "us_min": min(ts), "us_max": max(ts), **(extra or {})}
        except Exception as e:  # noqa: BLE001 - one failing candidate is reported, not fatal
            res[name] = {"error": f"{type(e).__name__}: {e}"[:500]}

    if phase != "cheap":
        return _compiled_candidate(phase, m, x, ws, args, budget, compile_cost, res, run)
    run("cublas", lambda: [F.linear(x, w) for w in ws])
    if "cublas_nt" not in args.skip:
        try:
            wts = [w.t().contiguous() for w in ws]
            run("cublas_nt", lambda: [x @ wt for wt in wts])
            del wts
        except Exception as e:  # noqa: BLE001
            res["cublas_nt"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    if cuda() and hasattr(torch.backends.cuda, "preferred_blas_library"):
        before = torch.backends.cuda.preferred_blas_library()
        run("cublaslt", lambda: [F.linear(x, w) for w in ws],
            setup=lambda: torch.backends.cuda.preferred_blas_library("cublaslt"),
            teardown=lambda: torch.backends.cuda.preferred_blas_library(before))
    if cuda():
        red = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        run("cublas_noredprec", lambda: [F.linear(x, w) for w in ws],
            setup=lambda: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False),
            teardown=lambda: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", red))
    # correctness of the Triton kernel against cuBLAS on this shape (bf16)
    if m <= skinny.MAX_ROWS and "triton" not in args.skip:
        ok, why = skinny.available()
        if not ok:
            res["triton"] = {"skipped": why}
        elif budget.left() < 8:
            res["triton"] = {"skipped": "budget"}
        else:
            try:
                t0 = time.perf_counter()
                tr = skinny.tune(m, ws, reps=args.reps)
                cfg = tr["config"]
                if cfg is None:
                    res["triton"] = {"error": "no config ran", "errors": tr["errors"]}
                else:
                    ref = F.linear(x, ws[0]).float()
                    err = (skinny.skinny_matmul(x, ws[0], cfg).float() - ref).abs().max().item()
                    # the winner re-timed like the others (tune's figure is a median of fewer replays)
                    ts = measure_us(lambda: [skinny.skinny_matmul(x, w, cfg) for w in ws], calls, args.reps)
                    res["triton"] = {"us": med(ts), "us_min": min(ts), "us_max": max(ts), "config": str(cfg),
                                     "max_abs_diff_vs_cublas": err, "max_abs_cublas": ref.abs().max().item(),
                                     "tune_s": time.perf_counter() - t0, "configs_us": tr["us"],
                                     "config_errors": tr["errors"]}
            except Exception as e:  # noqa: BLE001
                res["triton"] = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-800:]}
        if name == "down" and "us" in res.get("triton", {}):
            res["_swiglu_down_residual"] = fused_down(m, ws, args)
    return res


def fused_down(m: int, ws: list[torch.Tensor], args) -> dict:
    """The block's tail: y = x + g2 * down(silu(g) * u) from the gate/up GEMM's output, as the compiled cuBLAS path
    runs it (silu*mul kernel, GEMM, residual kernel; eager here) and as gemm=triton does (one skinny kernel)."""
    n, k = ws[0].shape
    tokens = 16
    b = max(1, m // tokens)
    gu = torch.randn(b, tokens, 2 * k, device=DEV, dtype=ws[0].dtype)
    x = torch.randn(b, tokens, n, device=DEV, dtype=ws[0].dtype)
    g2 = torch.randn(b, n, device=DEV, dtype=ws[0].dtype)
    out = {}

    def ref(w):
        g, u = gu.split(k, dim=-1)
        return x + g2[:, None] * F.linear(F.silu(g) * u, w)

    for cand, fn in (("cublas_eager_3_kernels", ref), ("triton_one_kernel", lambda w: skinny.skinny_swiglu_down(
            gu, w, x, g2))):
        try:
            ts = measure_us(lambda: [fn(w) for w in ws], len(ws), args.reps)
            out[cand] = {"us": med(ts)}
        except Exception as e:  # noqa: BLE001
            out[cand] = {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        fused = skinny.skinny_swiglu_down(gu, ws[0], x, g2).float()
        out["max_abs_diff"] = (ref(ws[0]).float() - fused).abs().max().item()
    except Exception as e:  # noqa: BLE001
        out["max_abs_diff"] = f"{type(e).__name__}: {e}"[:300]
    return out


def _compiled_candidate(name, m, x, ws, args, budget, compile_cost, res, run) -> dict:
    patch = {"autotune": {}, "autotune_tma": {"triton.enable_persistent_tma_matmul": True}}[name]
    if name in args.skip:
        res[name] = {"skipped": "--skip"}
        return res
    if m > args.autotune_max_rows:
        res[name] = {"skipped": f"rows > --autotune-max-rows {args.autotune_max_rows}"}
        return res
    est = compile_cost.get(name, args.autotune_estimate_s)
    if budget.left() < est + 3:
        res[name] = {"skipped": f"budget ({budget.left():.0f} s left, compile estimate {est:.0f} s)"}
        return res
    try:
        import torch._inductor.config as ic
        from torch._inductor.utils import run_and_get_code

        if patch and not all(_has_knob(ic, kk) for kk in patch):
            res[name] = {"skipped": f"knob missing in torch {torch.__version__}: {list(patch)}"}
            return res
        torch._dynamo.reset()        # a fresh compile per shape and knob set (no reuse of an earlier entry)
        with ic.patch(patch):
            fn = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
            t0 = time.perf_counter()
            _, codes = run_and_get_code(fn, x, ws[0])
            cs = time.perf_counter() - t0
            compile_cost[name] = cs
            code = "\n".join(codes)
            kind = ("decompose_k" if "decompose_k" in code else
                    "triton template" if "triton_tem" in code else
                    "aten (cuBLAS)" if "extern_kernels." in code else "other")
            run(name, lambda: [fn(x, w) for w in ws], extra={"compile_s": cs, "winner": kind})
    except Exception as e:  # noqa: BLE001
        res[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return res


def _has_knob(ic, dotted: str) -> bool:
    obj = ic
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def annotate(res: dict, m: int, n: int, k: int, ceil: dict, itemsize: int) -> None:
    wbytes, flops = n * k * itemsize, 2 * m * n * k
    floor_us = (n * k + m * k + m * n) * itemsize / (ceil["copy_tb_s"] * 1e12) * 1e6 \
        if ceil["copy_tb_s"] == ceil["copy_tb_s"] else None
    cands = {c: r for c, r in res.items() if not c.startswith("_")}
    for r in cands.values():
        if "us" in r:
            r["weight_gb_s"] = wbytes / r["us"] / 1e3
            r["of_copy_bw"] = r["weight_gb_s"] / (ceil["copy_tb_s"] * 1e3)
            r["tflops"] = flops / r["us"] / 1e6
            r["of_matmul_ceiling"] = r["tflops"] / ceil["bf16_matmul_tflops"]
    ok = {c: r["us"] for c, r in cands.items() if "us" in r}
    res["_best"] = {"candidate": min(ok, key=ok.get) if ok else None, "us": min(ok.values()) if ok else None,
                    "floor_us": floor_us, "weight_mb": wbytes / 1e6}


# ---------------------------------------------------------------------------------------------- non-GEMM work

def nongemm_ops(size: str, b: int, prefix_len: int, tokens: int, layers: int, dtype, reps: int) -> dict:
    """One block's non-GEMM ops at batch b (eager, in graphs), attention over `layers` distinct K/V buffers (each
    layer its own, as in the loop). Microseconds per block."""
    t = get_size(size).text
    hidden, heads, kvh, hd, eps = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], \
        t["head_dim"], 1e-6
    ffn = t["intermediate_size"]
    n, s = tokens, prefix_len + tokens
    g = torch.Generator(device=DEV).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=DEV, dtype=dtype, generator=g)

    x, sc, sh = r(b, n, hidden), r(b, hidden), r(b, hidden)
    qkv = r(b, n, (heads + 2 * kvh) * hd)
    qw, kw = r(hd), r(hd)
    cos, sin = r(b, n, hd), r(b, n, hd)
    kmask = torch.ones(b, s, dtype=torch.bool, device=DEV)
    kmask[:, prefix_len - 40:prefix_len] = False          # padded text, as in a real prompt
    bool_mask, add_mask = kmask[:, None, None, :], additive_mask(kmask, dtype)
    kexp = [r(b, heads, s, hd) for _ in range(layers)]
    vexp = [r(b, heads, s, hd) for _ in range(layers)]
    kroom = [r(b, kvh, s, hd) for _ in range(layers)]
    vroom = [r(b, kvh, s, hd) for _ in range(layers)]
    q = r(b, heads, n, hd)
    kk, vv = r(b, kvh, n, hd), r(b, kvh, n, hd)
    gate, up, y = r(b, n, ffn), r(b, n, ffn), r(b, n, hidden)
    g1 = r(b, hidden)

    def norm_mod():
        return F.rms_norm(x, (hidden,), eps=eps) * (1 + sc[:, None]) + sh[:, None]

    def qk_norm_rope():
        qq, k_, v_ = qkv.split((heads * hd, kvh * hd, kvh * hd), dim=-1)
        qq = F.rms_norm(qq.view(b, n, heads, hd), (hd,), qw, eps).transpose(1, 2)
        k_ = F.rms_norm(k_.view(b, n, kvh, hd), (hd,), kw, eps).transpose(1, 2)
        return _rope(qq, cos, sin), _rope(k_, cos, sin), v_.view(b, n, kvh, hd).transpose(1, 2)

    def write_kv(i=0):
        write_heads(kexp[i], kk, s - n)
        write_heads(vexp[i], vv, s - n)

    ops = {
        "norm1_modulation": (lambda: norm_mod(), 1),
        "qk_norm_rope": (lambda: qk_norm_rope(), 1),
        "write_kv_expanded": (lambda: [write_kv(i) for i in range(layers)], layers),
        "write_kv_room": (lambda: [(write_heads(kroom[i], kk, s - n), write_heads(vroom[i], vv, s - n))
                                   for i in range(layers)], layers),
        "sdpa_expanded_bool_mask": (lambda: [F.scaled_dot_product_attention(q, kexp[i], vexp[i], attn_mask=bool_mask)
                                             for i in range(layers)], layers),
        "sdpa_expanded_additive_mask": (lambda: [F.scaled_dot_product_attention(q, kexp[i], vexp[i],
                                                                                attn_mask=add_mask)
                                                 for i in range(layers)], layers),
        "sdpa_room_gqa_additive_mask": (lambda: [F.scaled_dot_product_attention(q, kroom[i], vroom[i],
                                                                                attn_mask=add_mask, enable_gqa=True)
                                                 for i in range(layers)], layers),
        # plain torch: scores GEMM, mask add + softmax, value GEMM (what a compiled region could run instead)
        "manual_attention_expanded": (lambda: [torch.softmax((q @ kexp[i].transpose(-1, -2)) * hd ** -0.5 + add_mask,
                                                             dim=-1) @ vexp[i] for i in range(layers)], layers),
        "residual_gate_norm2_modulation": (lambda: F.rms_norm(x + g1[:, None] * y, (hidden,), eps=eps)
                                           * (1 + sc[:, None]) + sh[:, None], 1),
        "silu_mul": (lambda: F.silu(gate) * up, 1),
        "residual_gate": (lambda: x + g1[:, None] * y, 1),
    }
    out: dict[str, dict] = {}
    for name, (fn, calls) in ops.items():
        try:
            ts = measure_us(fn, calls, reps)
            out[name] = {"us": med(ts)}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
    # which SDPA backend takes the expanded masked call, each forced in turn (and whether the mask is applied)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ref = F.scaled_dot_product_attention(q.float(), kexp[0].float(), vexp[0].float(), attn_mask=bool_mask)
        unmasked = F.scaled_dot_product_attention(q.float(), kexp[0].float(), vexp[0].float())
        back = {}
        for be in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"):
            if not hasattr(SDPBackend, be):
                continue
            for mname, mk in (("bool", bool_mask), ("additive", add_mask)):
                try:
                    with sdpa_kernel(getattr(SDPBackend, be)):
                        o = F.scaled_dot_product_attention(q, kexp[0], vexp[0], attn_mask=mk)
                        ts = measure_us(lambda: [F.scaled_dot_product_attention(q, kexp[i], vexp[i], attn_mask=mk)
                                                 for i in range(layers)], layers, reps)
                    back[f"{be}/{mname}"] = {"us": med(ts), "max_abs_diff_vs_fp32_masked":
                                             (o.float() - ref).abs().max().item(),
                                             "max_abs_diff_vs_fp32_unmasked": (o.float() - unmasked).abs().max().item()}
                except Exception as e:  # noqa: BLE001
                    back[f"{be}/{mname}"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        out["sdpa_backends"] = back
    except Exception as e:  # noqa: BLE001
        out["sdpa_backends"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out


def step_sums(res: dict, shp: dict, rows: list[int]) -> dict:
    """Per-step GEMM ms (one GEMM of each shape per block, x layers) for cuBLAS, the best candidate, the floor."""
    out = {}
    for m in rows:
        per = {c: 0.0 for c in ("cublas", "best", "floor")}
        complete = True
        for name in shp:
            r = next(v for v in res["gemm"].values() if v["_shape"]["name"] == name and v["_shape"]["M"] == m)
            if "us" not in r.get("cublas", {}) or r.get("_best", {}).get("us") is None:
                complete = False
                continue
            per["cublas"] += r["cublas"]["us"]
            per["best"] += r["_best"]["us"]
            per["floor"] += r["_best"]["floor_us"] or float("nan")
        out[str(m)] = {k: v * res["layers"] / 1e3 for k, v in per.items()} | {"complete": complete}
    return out


_BLOCK_REF: dict = {}     # the first variant's output (eager cuBLAS): what the others are compared with


def block_totals(size: str, b: int, prefix_len: int, tokens: int, nblocks: int, dtype, reps: int, args,
                 budget: Budget, phase: str = "eager") -> dict:
    """Whole generation blocks (model.GenBlock, fused weights, K/V in room layout with additive mask: what the loop
    runs) at nano-shape width, `nblocks` distinct blocks chained; microseconds per block for each variant."""
    torch.manual_seed(1234)      # the same blocks in every phase (eager / compiled): outputs compared across them
    t = get_size(size).text
    hidden, ffn, heads, kvh, hd = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], \
        t["num_key_value_heads"], t["head_dim"]
    s = prefix_len + tokens
    with torch.device(DEV):
        blocks = [GenBlock(hidden, ffn, heads, kvh, hd).to(dtype) for _ in range(nblocks)]
    for blk in blocks:
        for p in blk.parameters():
            p.requires_grad_(False)
            torch.nn.init.normal_(p, 0.0, 0.02)
    fused = [(torch.cat([bk.q_proj.weight, bk.k_proj.weight, bk.v_proj.weight]),
              torch.cat([bk.gate_proj.weight, bk.up_proj.weight])) for bk in blocks]
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(b, tokens, hidden, device=DEV, dtype=dtype, generator=g)
    tmod = torch.randn(b, 6, hidden, device=DEV, dtype=dtype, generator=g) * 0.1
    cos, sin = torch.ones(b, tokens, hd, device=DEV, dtype=dtype), torch.zeros(b, tokens, hd, device=DEV, dtype=dtype)
    kmask = torch.ones(b, s, dtype=torch.bool, device=DEV)
    kmask[:, prefix_len - 40:prefix_len] = False
    masks = {"additive": additive_mask(kmask, dtype), "bool": kmask[:, None, None, :]}
    ks = [torch.randn(b, heads, s, hd, device=DEV, dtype=dtype, generator=g) for _ in range(nblocks)]
    vs = [torch.randn(b, heads, s, hd, device=DEV, dtype=dtype, generator=g) for _ in range(nblocks)]

    def chain(mask):
        h, carry = x, None
        for i, blk in enumerate(blocks):
            h, carry = split_carry(blk(h, tmod, cos, sin, ks[i], vs[i], mask, True, fused[i], True, carry))
        return add_carry(h, carry)

    out: dict[str, dict] = {}
    variants = [("eager_cublas_additive", False, "cublas", "additive"), ("eager_cublas_bool", False, "cublas", "bool"),
                ("eager_triton_additive", False, "triton", "additive"),
                ("compiled_cublas_additive", True, "cublas", "additive"),
                ("compiled_triton_additive", True, "triton", "additive")]
    ref = None
    for name, compiled, gemm, mname in variants:
        if compiled != (phase == "compiled"):
            continue
        if "blocks_" + gemm in args.skip or ("compiled" in name and "blocks_compiled" in args.skip):
            out[name] = {"skipped": "--skip"}
            continue
        if gemm == "triton" and (b * tokens > skinny.MAX_ROWS or not skinny.available()[0]):
            out[name] = {"skipped": "triton kernel not applicable here"}
            continue
        if compiled and budget.left() < args.compile_estimate_s:
            out[name] = {"skipped": f"budget ({budget.left():.0f} s left)"}
            continue
        try:
            for blk in blocks:
                blk.compiled, blk.gemm = compiled, gemm
            t0 = time.perf_counter()
            with torch.no_grad():
                h = chain(masks[mname])      # compiles when compiled
                first_s = time.perf_counter() - t0
                ts = measure_us(lambda: chain(masks[mname]), nblocks, reps)
            ref = _BLOCK_REF.setdefault("ref", h.float())
            out[name] = {"us_per_block": med(ts), "first_call_s": first_s,
                         "max_abs_diff_vs_eager_cublas_additive": (h.float() - ref).abs().max().item(),
                         "max_abs_out": ref.abs().max().item()}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-800:]}
    for blk in blocks:
        blk.compiled, blk.gemm = False, "cublas"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="nano-shape")
    ap.add_argument("--rows", default="16,1024", help="GEMM row counts: batch x 16 action tokens")
    ap.add_argument("--reps", type=int, default=50, help="graph replays per candidate (median reported)")
    ap.add_argument("--budget-s", type=float, default=80.0, help="skip expensive candidates past this many seconds")
    ap.add_argument("--skip", default="", help="comma list of candidates / sections to leave out: cublas_nt, "
                    "triton, autotune, autotune_tma, nongemm, blocks, blocks_compiled, blocks_triton")
    ap.add_argument("--autotune-max-rows", type=int, default=16, help="autotune only GEMMs with <= this many rows")
    ap.add_argument("--autotune-estimate-s", type=float, default=25.0, help="first guess of one autotune compile")
    ap.add_argument("--compile-estimate-s", type=float, default=20.0, help="budget needed to compile a block")
    ap.add_argument("--weight-mb", type=float, default=256.0, help="weights cycled per GEMM candidate (> L2)")
    ap.add_argument("--layers", type=int, default=36, help="distinct K/V buffers for the attention timings")
    ap.add_argument("--blocks", type=int, default=4, help="distinct generation blocks chained in block_totals")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    import torch._dynamo

    for k in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, k):
            setattr(torch._dynamo.config, k, max(getattr(torch._dynamo.config, k), 64))
    global DEV
    DEV = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    budget = Budget(args.budget_s)
    out = Path(args.out)
    res: dict = {"args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
                 "device": torch.cuda.get_device_name(0) if cuda() else "cpu",
                 "date": time.strftime("%Y-%m-%d %H:%M:%S")}

    def save():
        out.write_text(json.dumps(res, indent=2, default=str))

    res["knobs"] = knobs()
    res["ceilings"] = ceil = ceilings()
    if cuda():
        torch.cuda.empty_cache()
    log("ceilings", ceil)
    save()
    p = get_size(args.size)
    tok_img = (p.image_size // p.vision["patch_size"] // p.vision["spatial_merge_size"]) ** 2
    prefix_len = 2 * (tok_img + 2) + p.max_text_len
    tokens = 16
    itemsize = torch.empty((), dtype=dtype).element_size()
    shp = shapes(args.size)
    rows = [int(r) for r in args.rows.split(",") if r]
    res["gemm"] = {}
    res["layers"] = p.text["num_hidden_layers"]
    compile_cost: dict[str, float] = {}
    weights = {}
    for name, (n, k) in shp.items():   # weights once per shape, shared by every row count and phase (~1 GB)
        copies = max(2, math.ceil(args.weight_mb * 1e6 / (n * k * itemsize)))
        weights[name] = [torch.randn(n, k, device=DEV, dtype=dtype) * 0.02 for _ in range(copies)]
    for name, (n, k) in shp.items():
        for m in rows:
            key = f"{name} M={m} K={k} N={n}"
            res["gemm"][key] = {"_shape": {"name": name, "M": m, "K": k, "N": n, "copies": len(weights[name])}}

    def gemm_phase(phase):
        for key, r in res["gemm"].items():
            sh = r["_shape"]
            log("gemm", phase, key, f"({sh['copies']} weight copies)")
            gemm_candidates(sh["M"], weights[sh["name"]], args, budget, compile_cost, phase, r, sh["name"])
            annotate(r, sh["M"], sh["N"], sh["K"], ceil, itemsize)
            log("  ", {c: (round(v["us"], 2), round(v.get("of_copy_bw", 0), 3)) if "us" in v else
                       v.get("skipped") or v.get("error", "")[:80] for c, v in r.items() if not c.startswith("_")})
            save()
        res["step_gemm_ms"] = step_sums(res, shp, rows)
        log("step GEMM ms", res["step_gemm_ms"])
        save()

    gemm_phase("cheap")
    if "nongemm" not in args.skip:
        log("non-GEMM ops, batch 1")
        try:
            ng = res["nongemm_b1_us_per_block"] = nongemm_ops(args.size, 1, prefix_len, tokens, args.layers, dtype,
                                                              args.reps)
            log("  ", {k: round(v["us"], 2) if "us" in v else v for k, v in ng.items() if k != "sdpa_backends"})
            log("   sdpa backends", ng.get("sdpa_backends"))
        except Exception as e:  # noqa: BLE001
            res["nongemm_b1_us_per_block"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        save()
    for phase in ("eager", "compiled"):
        if "blocks" in args.skip:
            break
        log(f"whole blocks, batch 1 ({phase})")
        try:
            bt = block_totals(args.size, 1, prefix_len, tokens, args.blocks, dtype, max(10, args.reps // 5), args,
                              budget, phase)
            g16 = sum(next(v for v in res["gemm"].values() if v["_shape"]["name"] == nm and v["_shape"]["M"] == 16)
                      ["cublas"].get("us", float("nan")) for nm in shp) if 16 in rows else float("nan")
            for v in bt.values():
                if "us_per_block" in v:
                    v["us_per_block_minus_cublas_gemms"] = v["us_per_block"] - g16
                    v["step_ms_estimate"] = v["us_per_block"] * res["layers"] / 1e3
            res.setdefault("blocks_b1", {}).update(bt)
            log("  ", {k: (round(v["us_per_block"], 1), round(v.get("step_ms_estimate", 0), 3)) if "us_per_block" in v
                       else v.get("skipped") or v.get("error", "")[:120] for k, v in bt.items()})
        except Exception as e:  # noqa: BLE001
            res.setdefault("blocks_b1", {})[f"{phase}_error"] = {"error": f"{type(e).__name__}: {e}"[:500],
                                                                  "trace": traceback.format_exc()[-800:]}
        save()
        if phase == "eager":
            gemm_phase("autotune")      # Inductor max-autotune per GEMM (M <= --autotune-max-rows) before the
    gemm_phase("autotune_tma")          # compiled blocks; its persistent-TMA variant last
    res["total_s"] = time.perf_counter() - T0
    save()
    log(f"wrote {out} in {res['total_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
