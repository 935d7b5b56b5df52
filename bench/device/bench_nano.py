"""Action server at Cosmos3-Nano scale on GPU: wam-ref nano-shape (random bf16 weights), 30 Euler steps, chunk 16.

    python bench/device/bench_nano.py --out $OUT/nano.json [--batches 1,2,4,8,16,32,64] [--modes eager,graphs]
        [--reps 5] [--http 1,16,64] [--http-seconds 8] [--profile 1,64] [--ngpu 1] [--check 1,8]
    python bench/device/bench_nano.py --out /tmp/nano.json --device cpu --size tiny --steps 2 --batches 1,2 \
        --reps 1 --http= --profile=1 --check 1        # CPU smoke run (no ceilings, host clock)

Measures, in one process on one GPU:
- ceilings: bf16 matmul 8192^3 on random data (the best of 3 medians of 10 after 3 warm-ups, CUDA events) and a 4 GiB
  device-to-device copy (bytes read + written);
- policy.predict per batch size and mode: eager | graphs (cuda_graphs=true, with prefix_graphs: the prefix pass is a
  graph too), optionally "+compile" (torch.compile of the blocks; modes after the first "+compile" one stay compiled,
  so list those last), "+nofuse" (fused=false: the reference path, one GEMM per projection, transformers' prefix
  forward), "+noprefix" (prefix_graphs=false), "+triton" / "+autotune" (gemm=triton | autotune for the denoising
  loop's GEMMs; otherwise the policy's own, `--policy-arg gemm=...` or its default, cublas) and ":expanded" /
  ":room" / ":folded" (kv_layout; no suffix: the policy's own, `--policy-arg kv_layout=...` or its default,
  folded; each row records the layout it ran);
  graphs modes first capture every bucket (policy.warmup, timed): wall-clock
  latency p50/p99 over `reps` calls after warm-up (includes CPU preprocessing and the copy back), plus the device
  time of each phase of one sample() in that mode (CUDA events at the phase boundaries: prefix = vision + understanding tower, loop = the denoising loop) and each phase's
  TFLOP/s (its FLOPs from policy.flops_per_observation over its time), and an eager vision-tower timing;
- --profile: torch.profiler of one sample() at those batch sizes in the last mode's configuration (graph replays
  included: their kernels are traced), as top kernels plus where each millisecond goes (phases; kernel time by
  category: GEMM, attention, norm/elementwise, copy, other);
- --check: the fast path (fused + CUDA graphs + prefix graphs, the gemm kernels of the last mode) against the eager
  reference (fused=false, no graphs, gemm=cublas) on the same inputs and seeds: max abs difference of the actions, also fused-eager vs
  reference (fusion alone), in the JSON under "check";
- then the HTTP path: `wamkit serve` (cuda_graphs=true) as a subprocess per GPU (--ngpu N: one server per GPU,
  clients spread round-robin), C concurrent client loops each sending one observation per request.
Writes a JSON with everything; bench/device/report.py turns it into markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from wamkit.core.types import Observation  # noqa: E402
from wamkit.policies import make_policy  # noqa: E402

DEVICE = torch.device("cuda")   # main() sets it from --device

TASKS = ["put the bowl on the plate", "open the top drawer and put the bowl inside",
         "pick up the ketchup and place it in the basket", "turn on the stove and put the moka pot on it"]


def log(*a):
    print(*a, flush=True)


def observations(n: int, seed: int = 0, side: int = 256) -> list[Observation]:
    rng = np.random.default_rng(seed)
    return [Observation({c: rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for c in ("image", "wrist_image")},
                        None, TASKS[i % len(TASKS)]) for i in range(n)]


def empty_cache() -> None:
    if on_cuda():
        torch.cuda.empty_cache()


def gpu_clock() -> dict | None:
    """The GPU's SM clock (MHz), power draw and limit (W) now, from nvidia-smi (None where it cannot be read)."""
    import subprocess

    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit",
                               "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True,
                              timeout=10).stdout.strip().splitlines()[0]
        sm, sm_max, draw, limit = (float(x) for x in line.split(","))
    except Exception:
        return None
    return {"sm_mhz": sm, "sm_max_mhz": sm_max, "power_w": draw, "power_limit_w": limit}


def _event_s(fn, calls: int = 1) -> float:
    """Device seconds per call of `calls` back-to-back fn() calls, between two CUDA events."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / 1e3 / calls


BURST_ROUNDS = 3   # the burst ceiling: the best of this many medians of 10 calls


def ceilings(sustain_s: float = 0.0) -> dict:
    """bf16 matmul 8192^3 TFLOP/s and device copy TB/s. The matmul figure is a burst (10 calls, ~15 ms: the GPU at
    its boost clock), the best of BURST_ROUNDS such medians (all kept: `bf16_matmul_tflops_rounds`): one median
    read 758.8 TFLOP/s on an H100 that measured 785.2 two minutes earlier (session 25), and a low ceiling inflates
    every "of burst" figure, so the ceiling is the highest reading. sustain_s > 0 also runs the matmul back to back
    for that long, as a batch-64 call keeps the GPU busy for seconds: past the power limit the SM clock drops (the
    H200 at 700 W: ~1590 MHz against 1980 in session 7's batch-64 rows), and the median TFLOP/s of its second half,
    with the clock and power read at its end, is the ceiling a sustained workload can be held to."""
    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    rounds = [2 * n ** 3 / statistics.median(_event_s(lambda: a @ b) for _ in range(10)) / 1e12
              for _ in range(BURST_ROUNDS)]
    out = {"bf16_matmul_tflops": max(rounds), "bf16_matmul_tflops_rounds": rounds, "bf16_matmul_clock": gpu_clock()}
    if sustain_s > 0:
        chunks, t_end = [], time.perf_counter() + sustain_s
        while time.perf_counter() < t_end:
            chunks.append(_event_s(lambda: a @ b, calls=20))
        out["bf16_matmul_clock_sustained"] = gpu_clock()
        out["bf16_matmul_tflops_sustained"] = 2 * n ** 3 / statistics.median(chunks[len(chunks) // 2:]) / 1e12
        out["bf16_matmul_sustained_s"] = sustain_s
    del a, b
    src = torch.randn(2 ** 30, device=dev)  # 4 GiB fp32
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    bw = 2 * src.numel() * 4 / statistics.median(_event_s(lambda: dst.copy_(src)) for _ in range(10)) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return {**out, "copy_tb_s": bw}


def on_cuda() -> bool:
    return DEVICE.type == "cuda"


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def timed(fn):
    """fn() and its time in ms: CUDA events on the GPU, the host clock on the CPU."""
    if not on_cuda():
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    out = fn()
    e1.record()
    e1.synchronize()
    return out, e0.elapsed_time(e1)


def phases(pol, inputs, seeds) -> dict:
    """Device ms of each phase of one sample() in the policy's current mode (engine.phase_ms)."""
    pol.engine.phase_ms = {}
    try:
        pol.sample(inputs, seeds)
        return dict(pol.engine.phase_ms)
    finally:
        pol.engine.phase_ms = None


def phase_tflops(f: dict, b: int, prefix_ms: float, loop_ms: float) -> dict:
    """TFLOP/s of the prefix (vision + understanding tower) and of the denoising loop at batch b."""
    return {"prefix_tflops": b * (f["vision"] + f["und_prefix"]) / prefix_ms / 1e9 if prefix_ms > 0 else None,
            "loop_tflops": b * f["steps"] * f["gen_per_step"] / loop_ms / 1e9 if loop_ms > 0 else None}


def bench_predict(pol, b: int, reps: int, f: dict) -> dict:
    obs, seeds = observations(b, seed=b), list(range(b))
    t0 = time.perf_counter()
    pol.predict(obs, seeds)          # warm-up (and graph capture for this bucket)
    first_ms = (time.perf_counter() - t0) * 1e3
    pol.predict(obs, seeds)
    lat = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        pol.predict(obs, seeds)
        lat.append((time.perf_counter() - t0) * 1e3)
    # predict's wall clock in parts (its inputs part is the host preprocessing + uploads, median of 5), then the
    # device-time split of one sample() in this mode: prefix pass vs denoising loop (CUDA events at the boundary)
    split, inputs = wall_split(pol, obs, seeds)
    ph = phases(pol, inputs, seeds)
    m = pol.model
    with torch.no_grad():
        try:   # the vision tower alone, eager (transformers' get_image_features): only a split of the timing
            _, vision_ms = timed(lambda: m.und.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]))
        except Exception:  # noqa: BLE001
            vision_ms = float("nan")
    q = np.percentile(lat, [50, 99])
    return {"batch": b, "p50_ms": float(q[0]), "p99_ms": float(q[1]), "mean_ms": float(np.mean(lat)),
            "obs_s": b / (float(q[0]) / 1e3), "first_call_ms": first_ms, "prep_ms": split["inputs"],
            "prep_ms_max": split.pop("inputs_max"), "prefix_ms": ph["prefix"], "vision_ms": vision_ms, "loop_ms": ph["denoise"],
            "sample_ms": ph["prefix"] + ph["denoise"],
            # the GPU's own rate (one sample()'s phases) and what the wall clock adds on top (host work, syncs)
            "device_tflops": b * f["total"] / (ph["prefix"] + ph["denoise"]) / 1e9,
            "host_ms": float(q[0]) - (ph["prefix"] + ph["denoise"]), **phase_tflops(f, b, ph["prefix"], ph["denoise"]),
            "prefix_graph_errors": [str(e) for e in pol.engine.prefix_graph_errors.values()], "reps": reps,
            "wall_split_ms": split}


def wall_split(pol, obs, seeds, reps: int = 5) -> tuple[dict, dict]:
    """Where predict's wall clock goes, each part synchronised before the next (median ms of `reps`): inputs
    (prepare_inputs and their upload; also inputs_max), sample (noise, the graph launches and the GPU's work, to
    the last kernel), out (the actions' download and the inverse action pipeline). Against the phases' device time,
    sample's excess is host work the GPU waits for. Returns (that split, the last model inputs)."""
    parts = {"inputs": [], "sample": [], "out": []}
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        inputs = pol.prepare_inputs([o.images for o in obs], [o.task for o in obs])
        sync()
        t1 = time.perf_counter()
        a = pol.sample(inputs, seeds)
        sync()
        t2 = time.perf_counter()
        pol.action_pipeline.inverse(a.cpu().numpy())
        t3 = time.perf_counter()
        for k, (u, w) in zip(parts, ((t0, t1), (t1, t2), (t2, t3))):
            parts[k].append((w - u) * 1e3)
    return {**{k: statistics.median(v) for k, v in parts.items()}, "inputs_max": max(parts["inputs"])}, inputs


# first match wins: attention before gemm (cuDNN's attention kernels are named cudnn_..._sdpa_sm90_flash_...)
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "efficient_attention", "sdpa")),
                ("gemm", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "matmul", "sm90_", "sm80_", "splitk",
                          "skinny", "sum_splits")),
                ("norm/elementwise", ("elementwise", "vectorized", "reduce", "norm", "triton", "silu", "gelu",
                                      "mul", "add", "rsqrt", "softmax")),
                ("copy", ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile(pol, b: int, rows: int = 25) -> dict:
    """One sample() at batch b in the policy's current mode under torch.profiler: the top kernels and where each
    millisecond goes (phase times from CUDA events; device kernel time summed by kind)."""
    obs, seeds = observations(b, seed=100 + b), list(range(b))
    inputs = pol.prepare_inputs([o.images for o in obs], [o.task for o in obs])
    pol.sample(inputs, seeds)        # capture / compile outside the profile
    ph = phases(pol, inputs, seeds)
    sync()
    events, kinds, kernels, by_phase, per_block = _trace(pol, inputs, seeds,
                                                         len(pol.model.gen.blocks) * pol.num_inference_steps)
    out = {"batch": b, "mode": {"cuda_graphs": pol.cuda_graphs, "prefix_graphs": pol.prefix_graphs,
                                "fused": pol.fused, "compile": pol.compile, "kv_layout": pol.kv_layout,
                                "gemm": pol.gemm},
           "phases_ms": ph, "kernel_ms_by_kind": kinds, "kernel_ms_total": round(sum(kinds.values()), 3),
           "kernel_launches": kernels, "kernel_ms_by_phase": by_phase, "loop_kernels_per_block_step": per_block,
           # device time of the phases not covered by kernels: launch gaps, host work between graph replays
           "idle_ms": round(sum(ph.values()) - sum(kinds.values()), 3) if on_cuda() else None,
           "table": events.table(sort_by="cuda_time_total" if on_cuda() else "cpu_time_total", row_limit=rows,
                                 max_name_column_width=70)}
    if on_cuda() and pol.cuda_graphs and kernels == 0:   # this profiler did not trace inside graph replays
        pol.cuda_graphs = False
        try:
            pol.sample(inputs, seeds)
            ev, out["kernel_ms_by_kind_eager"], out["kernel_launches_eager"], out["kernel_ms_by_phase_eager"], _ = \
                _trace(pol, inputs, seeds)
            out["table_eager"] = ev.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
        finally:
            pol.cuda_graphs = True
    return out


def kinds_by_phase(spans, kernels) -> dict[str, dict[str, float]]:
    """Device kernel ms by phase and kind. spans: (phase, start_us, end_us) of the phase ranges on the device
    timeline (wamkit.prefix, wamkit.denoise); kernels: (name, start_us, end_us). A kernel goes to the phase whose
    range holds its midpoint ("outside" where none does)."""
    out: dict[str, dict[str, float]] = {}
    for name, t0, t1 in kernels:
        mid = 0.5 * (t0 + t1)
        phase = next((ph for ph, a, b in spans if a <= mid <= b), "outside")
        kinds, kind = out.setdefault(phase, {}), kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + (t1 - t0) / 1e3
    return {ph: {k: round(v, 3) for k, v in sorted(kinds.items())} for ph, kinds in sorted(out.items())}


def block_step_kernels(spans, kernels, block_steps: int) -> list[dict]:
    """The denoising loop's kernels that run at least once per block and step (launched >= block_steps times in the
    denoise range: layers x steps), by name: launches per block and step, us per launch and ms in all, the most
    time first. What a change to the compiled blocks adds or removes shows here as a line gained or lost."""
    rng = next(((a, b) for ph, a, b in spans if ph == "denoise"), None)
    if rng is None or block_steps <= 0:
        return []
    per: dict[str, list[float]] = {}
    for name, t0, t1 in kernels:
        if rng[0] <= 0.5 * (t0 + t1) <= rng[1]:
            per.setdefault(name, []).append(t1 - t0)
    rows = [{"kernel": k, "per_block_step": round(len(v) / block_steps, 2), "us": round(sum(v) / len(v), 2),
             "ms": round(sum(v) / 1e3, 3)} for k, v in per.items() if len(v) >= block_steps]
    return sorted(rows, key=lambda r: -r["ms"])


def _device_spans(raw_events):
    """(phase spans, kernels) from torch.profiler's raw events: the device-side events only."""
    spans, kernels = [], []
    for e in raw_events:
        if not str(getattr(e, "device_type", "")).lower().endswith("cuda"):
            continue
        tr = e.time_range
        if e.name.startswith("wamkit."):
            spans.append((e.name[len("wamkit."):], tr.start, tr.end))
        elif not getattr(e, "is_user_annotation", False):
            kernels.append((e.name, tr.start, tr.end))
    return spans, kernels


def _trace(pol, inputs, seeds, block_steps: int = 0):
    """torch.profiler over one sample(): (key averages, device kernel ms by kind, kernel launches, device kernel ms
    by phase and kind, the loop's kernels per block and step (block_step_kernels): {} and [] off CUDA)."""
    from torch.profiler import ProfilerActivity, profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda() else [])
    with prof(activities=acts) as p:
        pol.sample(inputs, seeds)
        sync()
    events = p.key_averages()
    kinds: dict[str, float] = {}
    kernels = 0
    for e in events:
        # the phase ranges (wamkit.prefix / wamkit.denoise) carry device time too: they are not kernels
        if getattr(e, "is_user_annotation", False) or e.key.startswith("wamkit."):
            continue
        if on_cuda() and str(getattr(e, "device_type", "")).lower().endswith("cuda"):
            ms = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) / 1e3
            kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + ms
            kernels += e.count
    spans = _device_spans(p.events()) if on_cuda() else None
    by_phase = kinds_by_phase(*spans) if spans else {}
    per_block = block_step_kernels(*spans, block_steps) if spans else []
    return events, {k: round(v, 3) for k, v in sorted(kinds.items())}, kernels, by_phase, per_block


def check(pol, batches: list[int]) -> dict:
    """The fast path against the eager reference on the same observations and seeds: actions' max abs difference.
    fast = fused + cuda_graphs + prefix_graphs (compile, gemm and kv_layout as the policy has them now);
    fused_eager = fusion alone; reference = fused=false, no graphs, gemm=cublas, kv_layout=expanded (transformers'
    prefix forward, one GEMM per projection)."""
    saved = (pol.fused, pol.cuda_graphs, pol.prefix_graphs, pol.gemm, pol.kv_layout)
    out = {}
    try:
        for b in batches:
            obs, seeds = observations(b, seed=500 + b), list(range(1000, 1000 + b))
            pol.fused, pol.cuda_graphs, pol.gemm, pol.kv_layout = False, False, "cublas", "expanded"
            ref = pol.predict(obs, seeds)
            pol.fused, pol.gemm, pol.kv_layout = True, saved[3], saved[4]
            fused_eager = pol.predict(obs, seeds)
            pol.cuda_graphs, pol.prefix_graphs = True, True
            fast = pol.predict(obs, seeds)
            out[str(b)] = {"max_abs_diff": float(np.abs(fast - ref).max()),
                           "max_abs_diff_fused_eager": float(np.abs(fused_eager - ref).max()),
                           "max_abs_diff_graphs_vs_fused_eager": float(np.abs(fast - fused_eager).max()),
                           "max_abs_ref": float(np.abs(ref).max()),
                           "prefix_graph_errors": [str(e) for e in pol.engine.prefix_graph_errors.values()]}
            log(f"check b={b}: fast vs reference max |diff| {out[str(b)]['max_abs_diff']:.3g} (fused eager "
                f"{out[str(b)]['max_abs_diff_fused_eager']:.3g}; actions up to {out[str(b)]['max_abs_ref']:.3g})")
    finally:
        pol.fused, pol.cuda_graphs, pol.prefix_graphs, pol.gemm, pol.kv_layout = saved
    return {"dtype": str(pol.dtype), "gemm": pol.gemm, "kv_layout": pol.kv_layout, "batches": out}


async def http_load(urls: list[str], concurrency: int, seconds: float, obs: list[Observation]) -> dict:
    from wamkit.serve import ActionClient

    lat: list[float] = []
    done = 0
    clients = [ActionClient(u, max_connections=max(64, concurrency)) for u in urls]
    for c in clients:
        await c.__aenter__()
    try:
        for c in clients:  # warm-up: metadata, connection, and every graph bucket a batch may hit
            await c.predict([obs[0]], [0])
        stop_at = time.perf_counter() + seconds

        async def loop(k: int) -> None:
            nonlocal done
            c = clients[k % len(clients)]
            j = 0
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                await c.predict([obs[(k + j) % len(obs)]], [k * 100000 + j])
                lat.append((time.perf_counter() - t0) * 1000.0)
                done += 1
                j += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        wall = time.perf_counter() - t0
        mets = [(await c._client().get("/metrics")).json() for c in clients]
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)
    q = np.percentile(lat, [50, 99])
    return {"concurrency": concurrency, "servers": len(urls), "obs_s": done / wall, "p50_ms": float(q[0]),
            "p99_ms": float(q[1]), "n": done, "mean_batch": float(np.mean([m.get("mean_batch_size", 0) for m in mets]))}


def bench_http(args, policy_args: dict) -> list[dict]:
    from wamkit.serve import WamkitServerWorker

    workers = []
    try:
        for g in range(args.ngpu):
            env = {"CUDA_VISIBLE_DEVICES": str(g)} if args.ngpu > 1 else {}
            w = WamkitServerWorker("wam-ref", policy_args, max_batch_size=64, max_wait_ms=args.max_wait_ms,
                                   env=env, log_path=Path(args.out).with_suffix(f".server{g}.log"))
            w.start()
            workers.append(w)
        t0 = time.perf_counter()
        for w in workers:
            w.wait_healthy(timeout=600)
        log(f"http: {len(workers)} server(s) healthy after {time.perf_counter() - t0:.1f} s")
        urls = [w.url for w in workers]
        obs = observations(64, seed=7)
        rows = []
        for c in [int(x) for x in args.http.split(",") if x]:
            # first a short pass so that the graph buckets this load reaches are captured, then the timed pass
            asyncio.run(http_load(urls, c, 3.0, obs))
            r = asyncio.run(http_load(urls, c, args.http_seconds, obs))
            log(f"http C={c}: {r['obs_s']:.1f} obs/s p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms "
                f"mean batch {r['mean_batch']:.1f}")
            rows.append(r)
        return rows
    finally:
        for w in workers:
            w.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--modes", default="eager,graphs")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", default="1,64")
    ap.add_argument("--http", default="1,16,64")
    ap.add_argument("--http-seconds", type=float, default=8.0)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--ngpu", type=int, default=1)
    ap.add_argument("--size", default="nano-shape")
    ap.add_argument("--http-compile", default="false", help="compile=true for the served policy")
    ap.add_argument("--check", default="", help="batch sizes at which to compare the fast path with the eager "
                    "reference (max abs diff in the JSON), e.g. 1,8; empty: no check")
    ap.add_argument("--device", default="cuda", help="cuda | cpu (a smoke run: no ceilings, host-clock timings)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sustain-s", type=float, default=8.0,
                    help="seconds of back-to-back matmuls for the sustained matmul ceiling (0: the burst one only)")
    ap.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra wam-ref option for the in-process policy (repeatable), e.g. graph_buckets=1,64")
    args = ap.parse_args(argv)
    # batch sizes to profile; 0 or nothing: none (session 15's commands wrote --profile 0 for none)
    profile_batches = [b for b in (int(x) for x in args.profile.split(",") if x) if b > 0]
    global DEVICE
    DEVICE = torch.device(args.device)
    res: dict = {"args": vars(args), "device": torch.cuda.get_device_name(0) if on_cuda() else "cpu",
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(res, indent=2))

    res["ceilings"] = ceilings(args.sustain_s) if on_cuda() else {"bf16_matmul_tflops": float("nan"), "copy_tb_s": float("nan")}
    log("ceilings", res["ceilings"])
    save()
    policy_args = dict(size=args.size, device=args.device, dtype=args.dtype, num_inference_steps=args.steps,
                       horizon=16, action_dim=7)
    extra = dict(kv.split("=", 1) for kv in args.policy_arg)
    t0 = time.perf_counter()
    pol = make_policy("wam-ref", **policy_args, **extra)
    sync()
    res["build_s"] = time.perf_counter() - t0
    counts = pol.num_parameters()
    f = pol.flops_per_observation()
    gen_bytes = sum(p.numel() * p.element_size() for p in pol.model.gen.parameters())
    und_bytes = sum(p.numel() * p.element_size() for n, p in pol.model.und.named_parameters()
                    if "embed_tokens" not in n)
    bw = res["ceilings"]["copy_tb_s"] * 1e12
    res["model"] = {"params": counts, "flops": f, "gen_bytes": gen_bytes, "und_bytes_no_embed": und_bytes,
                    "floor_gen_ms": gen_bytes * args.steps / bw * 1e3,
                    "floor_all_ms": (gen_bytes * args.steps + und_bytes) / bw * 1e3,
                    "roofline_obs_s": res["ceilings"]["bf16_matmul_tflops"] * 1e12 / f["total"],
                    "prefix_len": pol.prefix_len,
                    "mem_gib_after_build": torch.cuda.memory_allocated() / 2 ** 30 if on_cuda() else None}
    log(f"built in {res['build_s']:.1f} s: {counts['total'] / 1e9:.2f}B params, {f['total'] / 1e12:.2f} TFLOP/obs, "
        f"floor {res['model']['floor_gen_ms']:.0f} ms (gen only) / {res['model']['floor_all_ms']:.0f} ms")
    save()
    res["predict"] = []
    batches = [int(x) for x in args.batches.split(",") if x]
    res["warmup"] = {}
    built_layout = pol.kv_layout   # what a mode without a ":layout" suffix runs (until session 15: expanded)
    built_gemm = pol.gemm          # ... and without "+triton" / "+autotune" (--policy-arg gemm=...; until session
                                   # 23 such a mode ran cublas whatever --policy-arg said)
    for mode in [x for x in args.modes.split(",") if x]:
        base, _, layout = mode.partition(":")
        pol.cuda_graphs = base.startswith("graphs")
        pol.kv_layout = layout or built_layout
        pol.fused = "+nofuse" not in base
        pol.prefix_graphs = "+noprefix" not in base
        pol.gemm = "triton" if "+triton" in base else "autotune" if "+autotune" in base else built_gemm
        if "+compile" in base and not pol.compile:
            t0 = time.perf_counter()
            pol.enable_compile()
            log(f"compile wrappers set in {time.perf_counter() - t0:.1f} s (compilation happens on first calls)")
        if pol.cuda_graphs:
            t0 = time.perf_counter()
            try:
                w = pol.warmup(max(batches))
            except Exception as e:  # keep going: record the failure
                log(f"{mode} warm-up FAILED: {type(e).__name__}: {e}")
                res["warmup"][mode] = {"error": f"{type(e).__name__}: {e}"}
                save()
                continue
            res["warmup"][mode] = {"total_s": time.perf_counter() - t0, "per_bucket_s": w}
            log(f"{mode} warm-up (every graph bucket): {res['warmup'][mode]['total_s']:.1f} s {w}")
        for b in batches:
            try:
                r = bench_predict(pol, b, args.reps, f)
            except Exception as e:  # keep going: record the failure
                log(f"{mode} b={b} FAILED: {type(e).__name__}: {e}")
                res["predict"].append({"mode": mode, "batch": b, "error": f"{type(e).__name__}: {e}"})
                save()
                continue
            r["mode"], r["kv_layout"] = mode, pol.kv_layout
            r["tflops"] = f["total"] * r["obs_s"] / 1e12
            r["mfu"] = r["tflops"] * 1e12 / (res["ceilings"]["bf16_matmul_tflops"] * 1e12)
            sustained = res["ceilings"].get("bf16_matmul_tflops_sustained")
            r["of_sustained_ceiling"] = r["tflops"] / sustained if sustained else None
            r["device_of_sustained_ceiling"] = r["device_tflops"] / sustained if sustained else None
            r["clock_end"] = gpu_clock() if on_cuda() else None   # the SM clock / power as the reps ended
            res["predict"].append(r)
            log(f"{mode:16s} [{pol.kv_layout}] b={b:3d}: p50 {r['p50_ms']:7.1f} ms p99 {r['p99_ms']:7.1f} ms "
                f"{r['obs_s']:6.1f} obs/s "
                f"{r['tflops']:5.0f} TFLOP/s ({100 * r['mfu']:.0f}% of burst ceiling"
                + (f", {100 * r['of_sustained_ceiling']:.0f}% of sustained" if r["of_sustained_ceiling"] else "")
                + (f"; {r['clock_end']['sm_mhz']:.0f} MHz {r['clock_end']['power_w']:.0f} W" if r["clock_end"]
                   else "") + f"; GPU alone {r['device_tflops']:.0f} TFLOP/s, wall adds {r['host_ms']:.1f} ms) | "
                f"prep {r['prep_ms']:.1f} (max {r['prep_ms_max']:.1f}) prefix {r['prefix_ms']:.1f} "
                f"({r['prefix_tflops'] or 0:.0f} TFLOP/s; eager vision {r['vision_ms']:.1f}) loop "
                f"{r['loop_ms']:.1f} ms ({r['loop_tflops'] or 0:.0f} TFLOP/s) | first call {r['first_call_ms']:.0f} ms"
                f" | wall split: " + ", ".join(f"{k} {v:.1f}" for k, v in r["wall_split_ms"].items()) + " ms")
            save()
        res["gemm_tuning"] = {str(k): {"config": str(v.get("config")), "us": v.get("us")}
                              for k, v in pol.engine.gemm_tuning.items()}
        if profile_batches and mode == [x for x in args.modes.split(",") if x][-1]:
            break   # keep the last mode's graphs: --profile runs in it
        pol.release_graphs()   # free this mode's graphs, their pool and static buffers
        empty_cache()
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if on_cuda() else None
    res["profile"] = {}
    for b in profile_batches:
        try:
            pr = res["profile"][str(b)] = profile(pol, b)
            log(f"--- profile sample() b={b} {pr['mode']}: phases {pr['phases_ms']} kernels by kind "
                f"{pr['kernel_ms_by_kind']} ({pr['kernel_launches']} launches); by phase "
                f"{pr['kernel_ms_by_phase']}\n" + pr["table"] + "\nthe loop's kernels per block and step:\n"
                + "\n".join(f"  {r['per_block_step']:5.2f} x {r['us']:8.2f} us = {r['ms']:8.3f} ms  {r['kernel'][:90]}"
                            for r in pr["loop_kernels_per_block_step"]))
        except Exception as e:
            log(f"profile b={b} FAILED: {type(e).__name__}: {e}")
        save()
    pol.release_graphs()
    if args.check:
        try:
            res["check"] = check(pol, [int(x) for x in args.check.split(",") if x])
        except Exception as e:
            log(f"check FAILED: {type(e).__name__}: {e}")
            res["check"] = {"error": f"{type(e).__name__}: {e}"}
        save()
    del pol
    empty_cache()
    if args.http and on_cuda():
        try:
            res["http"] = bench_http(args, dict(policy_args, cuda_graphs="true", compile=args.http_compile))
        except Exception as e:
            log(f"http FAILED: {type(e).__name__}: {e}")
            res["http_error"] = f"{type(e).__name__}: {e}"
    save()
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
