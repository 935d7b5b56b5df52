"""HTTP front-end vs in-process: does `wamkit serve` with N concurrent clients reach the policy's own throughput?

    # CPU: a policy that sleeps like a GPU computes, 240 + 20 ms per observation (the H200's nano-shape cost curve)
    PYTHONPATH=src python bench/bench_http_frontend.py --policy fixed-cost \
        --policy-args base_ms=240 per_obs_ms=20 max_batch_size=64 --batch 64 --clients 64 --seconds 20 \
        --out bench/results/http_frontend.json
    # GPU (one H200): two commands of ~6 minutes each (every variant builds its own server)
    PYTHONPATH=src python bench/bench_http_frontend.py --policy wam-ref --policy-args size=nano-shape \
        dtype=bfloat16 num_inference_steps=30 horizon=16 action_dim=7 cuda_graphs=true --device cuda \
        --batch 64 --clients 64 --client-procs 8 --seconds 20 --warmup-seconds 10 --inproc-seconds 15 \
        --variants max_wait_fraction=0 max_wait_fraction=0.25 --out /tmp/http_frontend_h200_a.json
    (the same with --variants policy_process=true policy_process=true,max_wait_fraction=0.25 --out ..._b.json)

1. in-process: `policy.predict` on batches of B observations, back to back (after `policy.warmup(B)`): obs/s.
2. HTTP: `wamkit serve policy=... max_batch_size=B` (more keys with --serve-args k=v), one server per --variants
   entry (default: as is; max_wait_fraction=0.25 (refill); policy_process=true; both: docs/serving.md "Batching").
   N concurrent client loops spread over --client-procs processes, each process one wamkit ActionClient
   (wamkit.protocol.client); every loop sends one observation (the policy's cameras at --image-side px, its state)
   per request and waits for its chunk (closed loop, like N env workers). Per codec (msgpack: raw uint8 arrays;
   json: what ActionClient(binary=False) sends, PNG + base64): obs/s over the timed window (after a warm-up
   window), latency p50/p99, the server's mean batch and batch-size histogram over the window (/metrics deltas),
   ratio = HTTP obs/s / in-process obs/s at the same batch size.
Output: one JSON document (stdout and --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from wamkit.core.types import Observation


def parse_kv(items: list[str]) -> dict[str, str]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {it!r}")
        out[k] = v
    return out


def make_obs(i: int, side: int, cameras: list[str], state_dim: int) -> Observation:
    rng = np.random.default_rng(i)
    return Observation({c: rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for c in cameras},
                       rng.standard_normal(state_dim).astype(np.float32) if state_dim else None,
                       "put the bowl on the plate")


def in_process(args, policy_args: dict) -> dict:
    from wamkit.core.device import resolve_device
    from wamkit.policies import make_policy

    pol = make_policy(args.policy, **{"device": resolve_device(args.device), **policy_args})
    spec = pol.spec
    cams = [c for c in spec.input.cameras if c] or ["image"]
    obs = [make_obs(i, args.image_side, cams, spec.input.state_dim) for i in range(args.batch)]
    pol.warmup(args.batch)
    pol.predict(obs, list(range(args.batch)))
    n, t0 = 0, time.perf_counter()
    while True:
        pol.predict(obs, list(range(n, n + args.batch)))
        n += args.batch
        dt = time.perf_counter() - t0
        if dt >= args.inproc_seconds and n >= 3 * args.batch:
            break
    pol.close()
    del pol
    if "torch" in sys.modules:          # give the GPU memory back before the server loads its own copy
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"obs_s": n / dt, "batch": args.batch, "batches": n // args.batch, "seconds": dt,
            "batch_ms": dt * 1000.0 / (n // args.batch)}


def _client_proc(url: str, loops: int, first: int, binary: bool, t_begin: float, t_end: float, t_stop: float,
                 side: int, cams: list[str], state_dim: int, q) -> None:
    """One client process: `loops` closed loops over one ActionClient; reports responses completed in [t_begin, t_end]
    and their latencies."""
    from wamkit.protocol.client import ActionClient

    obs = [make_obs(first + k, side, cams, state_dim) for k in range(min(loops, 16))]

    async def run() -> dict:
        lat: list[float] = []
        done, errors = 0, 0
        async with ActionClient(url, max_connections=max(8, loops), binary=binary, timeout_s=600) as c:
            await c.metadata()

            async def loop(k: int) -> None:
                nonlocal done, errors
                j = 0
                while time.time() < t_stop:
                    s0 = time.time()
                    try:
                        await c.predict([obs[k % len(obs)]], [(first + k) * 1000003 + j])
                    except Exception:  # noqa: BLE001 - counted; the bench reports it
                        errors += 1
                        continue
                    s1 = time.time()
                    if t_begin <= s1 <= t_end:
                        done += 1
                        lat.append((s1 - s0) * 1000.0)
                    j += 1
            await asyncio.gather(*(loop(k) for k in range(loops)))
        return {"done": done, "lat": lat, "errors": errors}

    q.put(asyncio.run(run()))


def _metrics(url: str) -> dict:
    import httpx

    return httpx.get(url + "/metrics", headers={"accept": "application/json"}, timeout=30).json()


def http_run(args, url: str, binary: bool, cams: list[str], state_dim: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = max(1, min(args.client_procs, args.clients))
    per = [args.clients // procs + (1 if i < args.clients % procs else 0) for i in range(procs)]
    t0 = time.time() + 3.0 + 0.5 * procs            # spawn time: every process starts its loops at once
    t_begin = t0 + args.warmup_seconds
    t_end = t_begin + args.seconds
    t_stop = t_end
    ps, first = [], 0
    for n in per:
        p = ctx.Process(target=_client_proc, args=(url, n, first, binary, t_begin, t_end, t_stop, args.image_side,
                                                   cams, state_dim, q), daemon=True)
        p.start()
        ps.append(p)
        first += n
    time.sleep(max(0.0, t_begin - time.time()))
    m0 = _metrics(url)
    time.sleep(max(0.0, t_end - time.time()))
    m1 = _metrics(url)
    outs = [q.get(timeout=args.seconds + 600) for _ in ps]
    for p in ps:
        p.join(timeout=60)
    done = sum(o["done"] for o in outs)
    lat = [x for o in outs for x in o["lat"]]
    c0, c1 = m0["counts"], m1["counts"]
    nb = c1.get("batches", 0) - c0.get("batches", 0)
    no = c1.get("observations_computed", 0) - c0.get("observations_computed", 0)
    hist = {k: v - m0["batch_size_histogram"].get(k, 0) for k, v in m1["batch_size_histogram"].items()}
    q50, q99 = (np.percentile(lat, [50, 99]).tolist() if lat else (None, None))
    return {"codec": "msgpack" if binary else "json", "clients": args.clients, "client_procs": procs,
            "obs_s": done / args.seconds, "server_obs_s": no / args.seconds, "mean_batch": (no / nb) if nb else None,
            "batch_histogram": {k: v for k, v in hist.items() if v}, "p50_ms": q50, "p99_ms": q99,
            "errors": sum(o["errors"] for o in outs),
            "server_compute_ms_p50": m1["compute_ms"]["p50"], "server_queue_ms_p50": m1["queue_ms"]["p50"]}


def http_variant(args, policy_args: dict, serve_args: dict, inproc: dict | None) -> list[dict]:
    """One `wamkit serve` (or --url) with `serve_args`, measured with every codec."""
    from wamkit.serve import WamkitServerWorker

    serve_args = dict(serve_args)
    log = Path(tempfile.gettempdir()) / (Path(args.out or "bench_http_frontend").stem + ".server.log")
    w = WamkitServerWorker(args.policy, policy_args, max_batch_size=args.batch,
                           max_wait_ms=float(serve_args.pop("max_wait_ms", 5.0)),
                           extra_args={"device": args.device, "log_every_s": 0, "max_queue": 4096, **serve_args},
                           log_path=log)
    rows = []
    with (contextlib.nullcontext() if args.url else w):
        url = args.url or w.url
        if not args.url:
            w.wait_healthy(timeout=900)
        import httpx

        md = httpx.get(url + "/v1/actions/metadata", timeout=30).json()
        cams = [c for c in md["input"]["image_keys"] if c] or ["image"]
        sd = md["input"]["state_dim"] or 0
        for codec in [c for c in args.codecs.split(",") if c]:
            r = {"variant": serve_args, **http_run(args, url, codec == "msgpack", cams, sd)}
            if inproc:
                r["ratio"] = r["obs_s"] / inproc["obs_s"]
            rows.append(r)
            print(f"http {codec} N={args.clients} {serve_args}: {r['obs_s']:.1f} obs/s mean batch "
                  f"{r['mean_batch'] and round(r['mean_batch'], 1)} p50 {r['p50_ms'] and round(r['p50_ms'])} ms "
                  f"ratio {r.get('ratio', float('nan')):.2f} errors {r['errors']}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="fixed-cost")
    ap.add_argument("--policy-args", nargs="*", default=["base_ms=240", "per_obs_ms=20", "max_batch_size=64"],
                    help="policy constructor keys, k=v")
    ap.add_argument("--serve-args", nargs="*", default=[], help="more `wamkit serve` keys, k=v (every variant)")
    ap.add_argument("--variants", nargs="*", default=["max_wait_fraction=0", "max_wait_fraction=0.25",
                                                      "policy_process=true",
                                                      "policy_process=true,max_wait_fraction=0.25"],
                    help="one server per variant: comma-separated `wamkit serve` keys (k=v,k=v)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=64, help="B: in-process batch and the server's max_batch_size")
    ap.add_argument("--clients", type=int, default=64, help="N concurrent client loops")
    ap.add_argument("--client-procs", type=int, default=4, help="processes the client loops are spread over")
    ap.add_argument("--codecs", default="msgpack,json")
    ap.add_argument("--image-side", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=20.0, help="timed HTTP window per codec")
    ap.add_argument("--warmup-seconds", type=float, default=5.0, help="HTTP load before the timed window")
    ap.add_argument("--inproc-seconds", type=float, default=10.0)
    ap.add_argument("--skip-inproc", action="store_true")
    ap.add_argument("--url", default="", help="measure this running server instead of starting one")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    policy_args = parse_kv(args.policy_args)
    serve_args = parse_kv(args.serve_args)
    res: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                 "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, load average at start "
                            f"{os.getloadavg()[0]:.1f}",
                 "policy": args.policy, "policy_args": policy_args, "serve_args": serve_args, "batch": args.batch}
    if not args.skip_inproc:
        res["in_process"] = in_process(args, policy_args)
        print(f"in-process B={args.batch}: {res['in_process']['obs_s']:.1f} obs/s "
              f"({res['in_process']['batch_ms']:.0f} ms per batch)", file=sys.stderr, flush=True)
    res["http"] = []
    for variant in args.variants:
        extra = {**serve_args, **parse_kv([kv for kv in variant.split(",") if kv])}
        res["http"] += http_variant(args, policy_args, extra, res.get("in_process"))
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
