"""Closed-loop envs against one action server, per transport: the greedy (B=1, P=N) row's shape without simulators.

    PYTHONPATH=src .venv/bin/python bench/bench_transport_loop.py [--envs 16] [--chunk-ms 39] [--seconds 8] \
        [--rounds 2] [--protocols http,sglang-ws] [--out bench/results/transport_loop.md]

Server: `wamkit serve policy=fixed-cost` (20 ms of sleep per batch, whatever its size: a GPU's flat cost) started
as `wamkit eval` starts its servers (eval.inference.start_server_workers: max_wait_ms 2, idle_dispatch on).
Client: one ServerInference (the path `wamkit eval inference=server` uses; server.protocol = wamkit for http, or
sglang-ws) shared by `envs` loops, each: send one MetaWorld-shaped observation, await its chunk, sleep chunk-ms (the
simulation of a chunk; the event loop is free meanwhile, as with env worker processes), repeat. Per protocol:
observations/s, the mean server batch (from the replies' timing), the median round trip, and the env-loop bound
envs / (chunk + the median round trip). Rounds interleave the protocols (A/B, then B/A) on one fresh server each.
What it checks: that a transport which delivers a request only once its frame has fully arrived (the websockets)
still lets the server batch concurrent envs together as HTTP does, since `wamkit eval` now speaks sglang-ws to the
servers it starts (bench/results/request_overhead.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_request_overhead import POLICY_ARGS, SERVER, WIRE, make_obs  # noqa: E402


async def loop_run(worker, protocol: str, envs: int, chunk_s: float, seconds: float) -> dict:
    from wamkit.eval.config import ServerOptions
    from wamkit.eval.inference import ServerInference

    inf = ServerInference(policy="fixed-cost", policy_args=POLICY_ARGS,
                          options=ServerOptions(**SERVER, protocol=WIRE[protocol]), workers=[worker])
    starts: set = set()
    counting = [False]

    def on_timing(rec: dict) -> None:   # every reply's server timing: distinct t_start = distinct server batches
        t = rec.get("server") or {}
        if counting[0] and "t_start" in t:
            starts.add(float(t["t_start"]))

    inf._on_timing = on_timing          # read by start(), which hands it to the client
    await inf.start()
    obs = [make_obs(i) for i in range(envs)]
    rtts: list[float] = []
    done = 0
    try:
        await asyncio.gather(*(inf.predict([o], [i]) for i, o in enumerate(obs)))   # warm-up
        stop = time.perf_counter() + seconds

        async def env(i: int) -> None:
            nonlocal done
            k = 0
            while time.perf_counter() < stop:
                t = time.perf_counter()
                await inf.predict([obs[i]], [i * 100000 + k])
                rtts.append(time.perf_counter() - t)
                done += 1
                k += 1
                await asyncio.sleep(chunk_s)

        counting[0] = True
        t0 = time.perf_counter()
        await asyncio.gather(*(env(i) for i in range(envs)))
        wall = time.perf_counter() - t0
    finally:
        await inf.close()
    rtt = statistics.median(rtts)
    return {"obs_per_s": done / wall, "mean_batch": done / max(1, len(starts)),
            "rtt_ms": rtt * 1000.0, "loop_bound": envs / (chunk_s + rtt)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--chunk-ms", type=float, default=39.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--protocols", default="http,sglang-ws")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "transport_loop.md"))
    a = ap.parse_args()
    from _common import cpu_model
    from wamkit.eval.config import ServerOptions
    from wamkit.eval.inference import start_server_workers

    protocols = [p.strip() for p in a.protocols.split(",") if p.strip()]
    got: dict[str, list[dict]] = {p: [] for p in protocols}
    for rnd in range(a.rounds):
        [w] = start_server_workers("fixed-cost", POLICY_ARGS, ServerOptions(**SERVER, serve_args={"log_every_s": 0}))
        try:
            for p in (protocols if rnd % 2 == 0 else protocols[::-1]):
                got[p].append(asyncio.run(loop_run(w, p, a.envs, a.chunk_ms / 1000.0, a.seconds)))
                print(f"round {rnd + 1} {p}: {got[p][-1]}", file=sys.stderr, flush=True)
        finally:
            w.stop()
    lines = [f"## {datetime.datetime.now():%Y-%m-%d %H:%M}: {a.envs} envs, chunk {a.chunk_ms:.0f} ms, "
             f"{a.seconds:.0f} s x {a.rounds} rounds",
             "", f"- machine: {cpu_model()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
             f"load average at end {os.getloadavg()[0]:.1f}",
             f"- command: `PYTHONPATH=src .venv/bin/python bench/bench_transport_loop.py --envs {a.envs} "
             f"--chunk-ms {a.chunk_ms:g} --seconds {a.seconds:g} --rounds {a.rounds} --protocols {a.protocols}`", "",
             "| transport | obs/s (median; rounds) | mean server batch | round trip ms | env-loop bound obs/s | "
             "of the loop bound |", "|---|---|---|---|---|---|"]
    for p in protocols:
        rs = got[p]
        med = statistics.median(r["obs_per_s"] for r in rs)
        per = " / ".join(f"{r['obs_per_s']:.1f}" for r in rs)
        lines.append(f"| {p} | {med:.1f} ({per}) | "
                     f"{statistics.median(r['mean_batch'] for r in rs):.2f} | "
                     f"{statistics.median(r['rtt_ms'] for r in rs):.1f} | "
                     f"{statistics.median(r['loop_bound'] for r in rs):.1f} | "
                     f"{statistics.median(r['obs_per_s'] / r['loop_bound'] for r in rs):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    head = "" if out.exists() else "# Closed-loop envs per transport (`bench/bench_transport_loop.py`)\n\n"
    with out.open("a") as f:
        f.write(head + text + "\n")


if __name__ == "__main__":
    main()
