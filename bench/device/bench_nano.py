"""Action server at Cosmos3-Nano scale on GPU: wam-ref nano-shape (random bf16 weights), 30 Euler steps, chunk 16.

    python bench/device/bench_nano.py --out $OUT/nano.json [--batches 1,2,4,8,16,32,64] [--modes eager,graphs]
        [--reps 5] [--http 1,16,64] [--http-seconds 8] [--profile 1,64] [--ngpu 1]

Measures, in one process on one GPU:
- ceilings: bf16 matmul 8192^3 on random data (median of 10 after 3 warm-ups, CUDA events) and a 4 GiB
  device-to-device copy (bytes read + written);
- policy.predict per batch size and mode: eager | graphs (cuda_graphs=true), optionally "+compile" (torch.compile of
  the blocks; modes after the first "+compile" one stay compiled, so list those last) and ":room" (kv_layout=room
  instead of expanded); graphs modes first capture every bucket (policy.warmup, timed):
  wall-clock latency p50/p99 over `reps` calls after warm-up (includes CPU preprocessing and the copy back), plus a
  device-time split: prefix (vision + understanding tower, once per observation) and the denoising loop;
- torch.profiler top kernels of one eager sample() at the --profile batch sizes;
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

TASKS = ["put the bowl on the plate", "open the top drawer and put the bowl inside",
         "pick up the ketchup and place it in the basket", "turn on the stove and put the moka pot on it"]


def log(*a):
    print(*a, flush=True)


def observations(n: int, seed: int = 0, side: int = 256) -> list[Observation]:
    rng = np.random.default_rng(seed)
    return [Observation({c: rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for c in ("image", "wrist_image")},
                        None, TASKS[i % len(TASKS)]) for i in range(n)]


def ceilings() -> dict:
    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    mm = 2 * n ** 3 / statistics.median(ts) / 1e12
    del a, b
    src = torch.randn(2 ** 30, device=dev)  # 4 GiB fp32
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    bw = 2 * src.numel() * 4 / statistics.median(ts) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return {"bf16_matmul_tflops": mm, "copy_tb_s": bw}


def timed(fn):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    out = fn()
    e1.record()
    e1.synchronize()
    return out, e0.elapsed_time(e1)


def bench_predict(pol, b: int, reps: int) -> dict:
    obs, seeds = observations(b, seed=b), list(range(b))
    t0 = time.perf_counter()
    pol.predict(obs, seeds)          # warm-up (and graph capture for this bucket)
    first_ms = (time.perf_counter() - t0) * 1e3
    pol.predict(obs, seeds)
    lat = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pol.predict(obs, seeds)
        lat.append((time.perf_counter() - t0) * 1e3)
    # device-time split (one call): prefix pass vs the whole sample (prefix + loop)
    t0 = time.perf_counter()
    inputs = pol.prepare_inputs([o.images for o in obs], [o.task for o in obs])
    torch.cuda.synchronize()
    prep_ms = (time.perf_counter() - t0) * 1e3
    m = pol.model
    with torch.no_grad():
        _, prefix_ms = timed(lambda: m.encode_prefix(inputs["input_ids"], inputs["attention_mask"],
                                                     inputs["mm_token_type_ids"], inputs["pixel_values"],
                                                     inputs["image_grid_thw"], inputs["position_ids"]))
        try:
            _, vision_ms = timed(lambda: m.und.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]))
        except Exception:  # noqa: BLE001 - only a split of the timing
            vision_ms = float("nan")
        _, sample_ms = timed(lambda: pol.sample(inputs, seeds))
    q = np.percentile(lat, [50, 99])
    return {"batch": b, "p50_ms": float(q[0]), "p99_ms": float(q[1]), "mean_ms": float(np.mean(lat)),
            "obs_s": b / (float(q[0]) / 1e3), "first_call_ms": first_ms, "prep_ms": prep_ms,
            "prefix_ms": prefix_ms, "vision_ms": vision_ms, "loop_ms": sample_ms - prefix_ms, "sample_ms": sample_ms,
            "reps": reps}


def profile(pol, b: int, rows: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile as prof

    obs, seeds = observations(b, seed=100 + b), list(range(b))
    inputs = pol.prepare_inputs([o.images for o in obs], [o.task for o in obs])
    pol.sample(inputs, seeds)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        pol.sample(inputs, seeds)
        torch.cuda.synchronize()
    return p.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


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
    args = ap.parse_args(argv)
    res: dict = {"args": vars(args), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(res, indent=2))

    res["ceilings"] = ceilings()
    log("ceilings", res["ceilings"])
    save()
    policy_args = dict(size=args.size, device="cuda", dtype="bfloat16", num_inference_steps=args.steps, horizon=16,
                       action_dim=7)
    t0 = time.perf_counter()
    pol = make_policy("wam-ref", **policy_args)
    torch.cuda.synchronize()
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
                    "prefix_len": pol.prefix_len, "mem_gib_after_build": torch.cuda.memory_allocated() / 2 ** 30}
    log(f"built in {res['build_s']:.1f} s: {counts['total'] / 1e9:.2f}B params, {f['total'] / 1e12:.2f} TFLOP/obs, "
        f"floor {res['model']['floor_gen_ms']:.0f} ms (gen only) / {res['model']['floor_all_ms']:.0f} ms")
    save()
    res["predict"] = []
    batches = [int(x) for x in args.batches.split(",") if x]
    res["warmup"] = {}
    for mode in [x for x in args.modes.split(",") if x]:
        base, _, layout = mode.partition(":")
        pol.cuda_graphs = base.startswith("graphs")
        pol.kv_layout = layout or "expanded"
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
                r = bench_predict(pol, b, args.reps)
            except Exception as e:  # keep going: record the failure
                log(f"{mode} b={b} FAILED: {type(e).__name__}: {e}")
                res["predict"].append({"mode": mode, "batch": b, "error": f"{type(e).__name__}: {e}"})
                save()
                continue
            r["mode"] = mode
            r["tflops"] = f["total"] * r["obs_s"] / 1e12
            r["mfu"] = r["tflops"] * 1e12 / (res["ceilings"]["bf16_matmul_tflops"] * 1e12)
            res["predict"].append(r)
            log(f"{mode:16s} b={b:3d}: p50 {r['p50_ms']:7.1f} ms p99 {r['p99_ms']:7.1f} ms {r['obs_s']:6.1f} obs/s "
                f"{r['tflops']:5.0f} TFLOP/s | prep {r['prep_ms']:.1f} prefix {r['prefix_ms']:.1f} (vision "
                f"{r['vision_ms']:.1f}) loop {r['loop_ms']:.1f} ms | first call {r['first_call_ms']:.0f} ms")
            save()
        pol.release_graphs()   # free this mode's graphs, their pool and static buffers
        torch.cuda.empty_cache()
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    res["profile"] = {}
    pol.cuda_graphs = False
    for b in [int(x) for x in args.profile.split(",") if x]:
        try:
            res["profile"][str(b)] = profile(pol, b)
            log(f"--- profile eager sample() b={b}\n" + res["profile"][str(b)])
        except Exception as e:
            log(f"profile b={b} FAILED: {e}")
        save()
    del pol
    torch.cuda.empty_cache()
    if args.http:
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
