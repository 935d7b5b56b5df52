"""Websocket vs HTTP: per-request overhead of `wamkit serve`'s transports on loopback.

    .venv/bin/python bench/bench_ws.py [--reps 300] [--out bench/results/ws.md]

Server: `wamkit serve policy=zero max_wait_ms=0` (no inference cost, no batching wait: what is left is transport,
codec and the batcher hand-off). One observation per request: 2 cameras 256x256 RGB + 8-D state + prompt.
Transports: HTTP POST /v1/actions/generations (ActionClient, msgpack raw arrays), the openpi websocket
(WebsocketActionClient protocol=openpi, and openpi's own sync client WebsocketClientPolicy), SGLang's realtime
websocket (WebsocketActionClient protocol=sglang-ws).
Per transport: C concurrent loops (1 and 8), each sends one observation, waits for its chunk, repeats. Reported:
round trip p50 / p90, the server's own time (queue + compute, from its timing) subtracted from the round trip
(= transport + codecs overhead), throughput, and client / server CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from _common import cpu_model
from wamkit.core.types import Observation
from wamkit.serve import ActionClient, WamkitServerWorker
from wamkit.serve.ws_client import WebsocketActionClient

CONCURRENCY = (1, 8)


def make_obs(i: int, side: int = 256) -> Observation:
    rng = np.random.default_rng(i)
    return Observation({"image": rng.integers(0, 256, (side, side, 3), dtype=np.uint8),
                        "wrist_image": rng.integers(0, 256, (side, side, 3), dtype=np.uint8)},
                       rng.standard_normal(8).astype(np.float32), "put the bowl on the plate")


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def server_ms(t: dict) -> float:
    s = t.get("server") or {}
    return float(s.get("queue_ms", 0.0)) + float(s.get("compute_ms", 0.0))


def summarize(lat: list[float], srv: list[float], wall: float, ccpu: float, scpu: float, nbytes: int) -> dict:
    n = len(lat)
    q = np.percentile(lat, [50, 90])
    over = np.asarray(lat) - np.asarray(srv)
    return {"n": n, "p50": float(q[0]), "p90": float(q[1]), "overhead_p50": float(np.median(over)),
            "obs_s": n / wall, "client_cpu_ms": ccpu * 1000 / n, "server_cpu_ms": scpu * 1000 / n,
            "request_bytes": nbytes}


async def run_async(make_client, reps: int, concurrency: int, obs: list[Observation], pid: int) -> dict:
    lat: list[float] = []
    srv: list[float] = []
    nbytes = 0
    c = make_client()
    try:
        for k in range(max(8, concurrency)):   # warm-up: metadata, connections
            await c.predict([obs[k % len(obs)]], [k])

        async def loop(k: int) -> None:
            nonlocal nbytes
            for j in range(reps // concurrency):
                t0 = time.perf_counter()
                await c.predict([obs[(k + j) % len(obs)]], [k * 100000 + j])
                lat.append((time.perf_counter() - t0) * 1000.0)
                t = c.last_timings[0]
                srv.append(server_ms(t))
                nbytes = t["request_bytes"]
        t0, c0, s0 = time.perf_counter(), time.process_time(), cpu_s(pid)
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        wall, ccpu, scpu = time.perf_counter() - t0, time.process_time() - c0, cpu_s(pid) - s0
    finally:
        await c.aclose()
    return summarize(lat, srv, wall, ccpu, scpu, nbytes)


def run_openpi_client(host: str, port: int, reps: int, obs: list[Observation], pid: int) -> dict | None:
    try:
        from openpi_client.websocket_client_policy import WebsocketClientPolicy
    except ImportError:
        return None
    from wamkit.protocol.openpi import observation_to_openpi, packb

    els = [observation_to_openpi(o, i) for i, o in enumerate(obs)]
    p = WebsocketClientPolicy(host, port)
    for el in els:
        p.infer(el)
    lat, srv = [], []
    t0, c0, s0 = time.perf_counter(), time.process_time(), cpu_s(pid)
    for j in range(reps):
        t1 = time.perf_counter()
        r = p.infer(els[j % len(els)])
        lat.append((time.perf_counter() - t1) * 1000.0)
        srv.append(float(r["server_timing"]["queue_ms"]) + float(r["server_timing"]["compute_ms"]))
    wall, ccpu, scpu = time.perf_counter() - t0, time.process_time() - c0, cpu_s(pid) - s0
    p._ws.close()
    return summarize(lat, srv, wall, ccpu, scpu, len(packb(els[0])))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ws.md"))
    args = ap.parse_args()
    obs = [make_obs(i) for i in range(8)]
    rows: list[tuple[str, int, dict]] = []
    load0 = os.getloadavg()[0]
    with WamkitServerWorker("zero", {}, max_batch_size=64, max_wait_ms=0,
                            extra_args={"log_every_s": 0}) as w:
        transports = {
            "HTTP msgpack (ActionClient)": lambda: ActionClient(w.url),
            "websocket openpi (WebsocketActionClient)": lambda: WebsocketActionClient(w.url, protocol="openpi"),
            "websocket sglang-ws (WebsocketActionClient)": lambda: WebsocketActionClient(w.url,
                                                                                         protocol="sglang-ws"),
        }
        for c in CONCURRENCY:
            for name, make in transports.items():
                r = asyncio.run(run_async(make, args.reps, c, obs, w.pid))
                rows.append((name, c, r))
                print(f"{name:45s} C={c}: p50 {r['p50']:.2f} ms p90 {r['p90']:.2f} ms overhead p50 "
                      f"{r['overhead_p50']:.2f} ms {r['obs_s']:.0f} obs/s", file=sys.stderr, flush=True)
        r = run_openpi_client(w.host, w.port, args.reps, obs, w.pid)
        if r is not None:
            rows.append(("websocket openpi (openpi_client, sync)", 1, r))
            print(f"openpi_client C=1: p50 {r['p50']:.2f} ms overhead p50 {r['overhead_p50']:.2f} ms",
                  file=sys.stderr)
    lines = ["# Websocket vs HTTP per-request overhead (`bench/bench_ws.py`)", "",
             f"- command: `.venv/bin/python bench/bench_ws.py --reps {args.reps}`",
             f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
             f"- machine: {cpu_model()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, no GPU; "
             f"load average at start {load0:.1f} (client, server and anything else running share these cores)",
             "- server: `wamkit serve policy=zero max_wait_ms=0` on loopback (no inference cost, no batching wait)",
             "- request: one observation, 2 cameras 256x256 RGB uint8 + 8-D state + prompt (raw arrays: msgpack bin "
             "on HTTP, msgpack-numpy on the websockets)",
             "- C concurrent loops, each sends one request and waits for its chunk; round trip measured by the "
             "client; overhead = round trip - the server's queue + compute time (its own timing), i.e. transport "
             "+ codecs + event loops", "",
             "| transport | C | round trip p50 ms | p90 ms | overhead p50 ms | obs/s | client CPU ms/req | "
             "server CPU ms/req | request bytes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c, r in rows:
        lines.append(f"| {name} | {c} | {r['p50']:.2f} | {r['p90']:.2f} | {r['overhead_p50']:.2f} | "
                     f"{r['obs_s']:.0f} | {r['client_cpu_ms']:.2f} | {r['server_cpu_ms']:.2f} | "
                     f"{r['request_bytes']} |")
    lines.append("")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
