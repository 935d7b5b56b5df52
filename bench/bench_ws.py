"""Websocket vs HTTP: per-request overhead of `wamkit serve`'s transports on loopback.

    .venv/bin/python bench/bench_ws.py [--reps 400] [--rounds 10] [--out bench/results/ws.md]

Server: `wamkit serve policy=zero max_wait_ms=0` (no inference cost, no batching wait: what is left is transport,
codecs and the batcher hand-off). One observation per request: 2 cameras 256x256 RGB + 8-D state + prompt.
Transports: HTTP POST /v1/actions/generations (ActionClient, msgpack raw arrays), the openpi websocket
(WebsocketActionClient protocol=openpi, and openpi's own sync client WebsocketClientPolicy when installed), SGLang's
realtime websocket (WebsocketActionClient protocol=sglang-ws).
Per transport and concurrency C (1 and 8): C loops each send one observation, wait for its chunk, repeat; `reps`
requests in `rounds` blocks interleaved across transports (the machine's load drifts; interleaving spreads it over
all transports alike). Reported: round trip p50 / p90, overhead = round trip - the server's own queue + compute time
(transport + codecs + event loops), throughput, client / server CPU per request.
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
from wamkit.protocol.openpi import observation_to_openpi, packb
from wamkit.serve import ActionClient, WamkitServerWorker
from wamkit.serve.ws_client import WebsocketActionClient

CONCURRENCY = (1, 8)
OPENPI_SYNC = "websocket openpi (openpi_client, sync)"


def make_obs(i: int, side: int = 256) -> Observation:
    rng = np.random.default_rng(i)
    return Observation({"image": rng.integers(0, 256, (side, side, 3), dtype=np.uint8),
                        "wrist_image": rng.integers(0, 256, (side, side, 3), dtype=np.uint8)},
                       rng.standard_normal(8).astype(np.float32), "put the bowl on the plate")


def cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux /proc), seconds."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Acc:
    """What one transport measured at one concurrency, summed over the rounds."""

    def __init__(self):
        self.lat: list[float] = []
        self.srv: list[float] = []
        self.wall = self.ccpu = self.scpu = 0.0
        self.nbytes = 0

    def timed(self, pid: int):
        acc = self

        class _T:
            def __enter__(self):
                self.t, self.c, self.s = time.perf_counter(), time.process_time(), cpu_s(pid)

            def __exit__(self, *exc):
                acc.wall += time.perf_counter() - self.t
                acc.ccpu += time.process_time() - self.c
                acc.scpu += cpu_s(pid) - self.s
        return _T()

    def summary(self) -> dict:
        n = len(self.lat)
        q = np.percentile(self.lat, [50, 90])
        over = np.asarray(self.lat) - np.asarray(self.srv)
        return {"n": n, "p50": float(q[0]), "p90": float(q[1]), "overhead_p50": float(np.median(over)),
                "obs_s": n / self.wall, "client_cpu_ms": self.ccpu * 1000 / n,
                "server_cpu_ms": self.scpu * 1000 / n, "request_bytes": self.nbytes}


async def block_async(c, acc: Acc, reps: int, conc: int, obs: list[Observation], pid: int, base: int) -> None:
    async def loop(k: int) -> None:
        for j in range(reps // conc):
            t0 = time.perf_counter()
            await c.predict([obs[(k + j) % len(obs)]], [base + k * 100000 + j])
            acc.lat.append((time.perf_counter() - t0) * 1000.0)
            s = c.last_timings[0].get("server") or {}
            acc.srv.append(float(s.get("queue_ms", 0.0)) + float(s.get("compute_ms", 0.0)))
            acc.nbytes = c.last_timings[0]["request_bytes"]
    with acc.timed(pid):
        await asyncio.gather(*(loop(k) for k in range(conc)))


def block_openpi(policy, acc: Acc, reps: int, els: list[dict], pid: int) -> None:
    with acc.timed(pid):
        for j in range(reps):
            t0 = time.perf_counter()
            st = policy.infer(els[j % len(els)])["server_timing"]
            acc.lat.append((time.perf_counter() - t0) * 1000.0)
            acc.srv.append(float(st["queue_ms"]) + float(st["compute_ms"]))
    acc.nbytes = len(packb(els[0]))


async def measure(w, reps: int, rounds: int, obs: list[Observation]) -> list[tuple[str, int, dict]]:
    clients = {"HTTP msgpack (ActionClient)": ActionClient(w.url),
               "websocket openpi (WebsocketActionClient)": WebsocketActionClient(w.url, protocol="openpi"),
               "websocket sglang-ws (WebsocketActionClient)": WebsocketActionClient(w.url, protocol="sglang-ws")}
    els = [observation_to_openpi(o, i) for i, o in enumerate(obs)]
    try:
        from openpi_client.websocket_client_policy import WebsocketClientPolicy
        opc = WebsocketClientPolicy(w.host, w.port)
    except ImportError:
        opc = None
    rows: list[tuple[str, int, dict]] = []
    try:
        for c in clients.values():                       # warm-up: metadata, connections
            await c.predict(obs, list(range(len(obs))))
        if opc is not None:
            block_openpi(opc, Acc(), len(els), els, w.pid)
        for conc in CONCURRENCY:
            accs = {name: Acc() for name in clients}
            if conc == 1 and opc is not None:
                accs[OPENPI_SYNC] = Acc()
            for r in range(rounds):
                for name, acc in accs.items():
                    if name == OPENPI_SYNC:
                        block_openpi(opc, acc, reps // rounds, els, w.pid)
                    else:
                        await block_async(clients[name], acc, reps // rounds, conc, obs, w.pid, r * 10**7)
            for name, acc in accs.items():
                s = acc.summary()
                rows.append((name, conc, s))
                print(f"{name:45s} C={conc}: p50 {s['p50']:.2f} ms p90 {s['p90']:.2f} ms overhead p50 "
                      f"{s['overhead_p50']:.2f} ms {s['obs_s']:.0f} obs/s", file=sys.stderr, flush=True)
    finally:
        for c in clients.values():
            await c.aclose()
        if opc is not None:
            opc._ws.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ws.md"))
    args = ap.parse_args()
    obs = [make_obs(i) for i in range(8)]
    load0 = os.getloadavg()[0]
    with WamkitServerWorker("zero", {}, max_batch_size=64, max_wait_ms=0, extra_args={"log_every_s": 0}) as w:
        rows = asyncio.run(measure(w, args.reps, args.rounds, obs))
    load1 = os.getloadavg()[0]
    lines = ["# Websocket vs HTTP per-request overhead (`bench/bench_ws.py`)", "",
             f"- command: `.venv/bin/python bench/bench_ws.py --reps {args.reps} --rounds {args.rounds}`",
             f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
             f"- machine: {cpu_model()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, no GPU; "
             f"load average {load0:.1f} at start, {load1:.1f} at the end (client, server and anything else running "
             f"share these cores)",
             "- server: `wamkit serve policy=zero max_wait_ms=0` on loopback (no inference cost, no batching wait)",
             "- request: one observation, 2 cameras 256x256 RGB uint8 + 8-D state + prompt (raw arrays: msgpack bin "
             "on HTTP, msgpack-numpy on the websockets)",
             f"- C concurrent loops, each sends one request and waits for its chunk; {args.reps} requests per row in "
             f"{args.rounds} blocks interleaved across the transports; round trip measured by the client; "
             "overhead = round trip - the server's queue + compute time (its own timing): transport + codecs + "
             "event loops", "",
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
