"""Per-request overhead of the action server: client round trip minus server compute, and where it goes.

    PYTHONPATH=src .venv/bin/python bench/bench_request_overhead.py [--requests 30] [--rounds 3] \
        [--batches 1,4,8,16] [--protocols http,openpi,sglang-ws] [--label before] \
        [--out bench/results/request_overhead.md]

Server: a real `wamkit serve policy=fixed-cost policy_args.base_ms=20 policy_args.per_obs_ms=0
policy_args.mode=sleep` on 127.0.0.1 with max_batch_size=64 max_wait_ms=2.0 (MetaWorld's server settings in `wamkit
bench eval`; a batch costs 20 ms of sleep, whatever its size), started as `wamkit eval` starts its servers
(eval.inference.start_server_workers with ServerOptions' defaults) through a WamkitServerWorker subclass whose command
runs this file with `_probe_serve`: the same `wamkit serve` main, with perf_counter wrappers installed around the
server's own functions (ASGI app, _read_body, _decode, DynamicBatcher.submit, build_response + encode_body,
policy.predict) that write one JSON line per request to a file.
Client: the path `wamkit eval inference=server` uses (eval.inference.ServerInference over an attached worker ->
protocol.client.ActionClient), one request in flight at a time, MetaWorld-shaped observations (camera `image`
224x224x3 uint8, a 39-D float32 state, a task string), request sizes 1, 4, 8, 16; wrappers around build_request +
encode_body (encode), ActionClient._request (the HTTP exchange), decode_body + parse_response (decode).

Columns (medians over every request of every round, ms):
- rtt: ServerInference.predict, client side; compute: the reply's `timing.compute_ms`; overhead = rtt - compute.
- c.enc: client build_request + encode_body; c.dec: client decode_body + parse_response.
- s.recv: server _read_body; s.dec: server _decode (decode_body + parse_request), measured inside the call (in the
  decode thread for bodies over 256 KB); s.hop: the rest of the route handler outside read/decode/submit/response
  (the hop to the decode thread and back, the policy checks, group keys).
- queue: the reply's `timing.queue_ms` (arrival at the batcher to predict start); s.batch: submit's time beyond
  queue + compute (waking the awaiting handler).
- s.resp: build_response + encode_body.
- http: the client's HTTP exchange minus the server handler's time (httpx, sockets, uvicorn/h11 parsing, Starlette
  routing, writing the response).
- c.other: rtt minus (c.enc + HTTP exchange + c.dec): ServerInference / ActionClient bookkeeping.
- predict: policy.predict inside the worker thread (compute - predict = the hop to the predict thread and back).

--protocols (default http): the transports to compare, each through the client `wamkit eval` uses for it
(ServerInference with server.protocol = wamkit for http, openpi, sglang-ws; the same server, which answers all three;
sglang-ws+shm: sglang-ws with server.shm_arrays, images and states by reference through shared memory).
Every round starts one fresh server and runs every protocol on it, in turn (A/B/C, then C/B/A: this machine is
noisy), each over every request size. Websocket rows have their own, shorter columns (the server probe times the
HTTP route only):
- frames: frames one request went out as (openpi: one observation per frame, over as many connections; sglang-ws:
  one frame with every observation, as the server's metadata says it takes batches).
- batches: distinct server batches that answered one request (1: its observations were batched together; 2: the
  batcher ran the first arrivals before the rest came, one more compute in the round trip).
- compute: the median `compute_ms` of the request's frames; overhead = rtt - compute (so a request split over 2
  batches shows ~one more compute as overhead).
- c.enc: the codec's encode of every frame (with +shm: the copy into the shared-memory slot); c.dec: unpacking + decoding every reply.
With several protocols, a last table puts the overheads side by side, with each round's median (consistency).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROBE_ENV = "WAMKIT_BENCH_PROBE"
POLICY_ARGS = {"base_ms": 20, "per_obs_ms": 0, "mode": "sleep", "max_batch_size": 64, "horizon": 16,
               "action_dim": 4}
SERVER = {"max_batch_size": 64, "max_wait_ms": 2.0}


# ------------------------------------------------------------------------------------------- server side
def _probe_serve(argv: list[str]) -> int:
    """`wamkit serve` with timing wrappers (this runs in the server process)."""
    from time import perf_counter

    import wamkit.serve.app as app_mod
    from wamkit.policies.simple import FixedCostPolicy
    from wamkit.serve.batcher import DynamicBatcher

    out = open(os.environ[PROBE_ENV], "a", buffering=1)
    cur: dict = {}

    def timed(name, fn):
        def w(*a, **k):
            t = perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[name] = cur.get(name, 0.0) + (perf_counter() - t) * 1000.0
        return w

    def atimed(name, fn):
        async def w(*a, **k):
            t = perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                cur[name] = cur.get(name, 0.0) + (perf_counter() - t) * 1000.0
        return w

    FixedCostPolicy.predict = timed("predict", FixedCostPolicy.predict)
    app_mod.ActionServer._read_body = atimed("recv", app_mod.ActionServer._read_body)
    app_mod.ActionServer._decode = timed("dec", app_mod.ActionServer._decode)
    app_mod.build_response = timed("resp", app_mod.build_response)
    app_mod.encode_body = timed("resp", app_mod.encode_body)
    DynamicBatcher.submit = atimed("submit", DynamicBatcher.submit)
    app_mod.ActionServer.generations = atimed("handler", app_mod.ActionServer.generations)

    orig_create = app_mod.create_app

    def create_app(cfg, policy=None):
        app = orig_create(cfg, policy)

        class Probe:   # pure ASGI middleware: the whole exchange as the app sees it, response sent included
            def __init__(self, inner):
                self.inner = inner

            async def __call__(self, scope, receive, send):
                if scope["type"] != "http" or not scope["path"].endswith("/generations"):
                    return await self.inner(scope, receive, send)
                cur.clear()
                t = perf_counter()
                await self.inner(scope, receive, send)
                cur["asgi"] = (perf_counter() - t) * 1000.0
                out.write(json.dumps(cur) + "\n")

        app.add_middleware(Probe)
        return app

    app_mod.create_app = create_app
    from wamkit.cli import serve_cmd   # its main imports create_app from wamkit.serve.app at call time

    return serve_cmd.main(argv)


# ------------------------------------------------------------------------------------------- client side
def make_obs(i: int):
    import numpy as np

    from wamkit.core.types import Observation

    rng = np.random.default_rng(i)
    return Observation({"image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)},
                       rng.standard_normal(39).astype(np.float32), "reach the goal")


def install_client_probe(cur: dict) -> None:
    import wamkit.protocol.client as cl

    def timed(name, fn):
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[name] = cur.get(name, 0.0) + (time.perf_counter() - t) * 1000.0
        return w

    cl.build_request = timed("c_enc", cl.build_request)
    cl.encode_body = timed("c_enc", cl.encode_body)
    cl.decode_body = timed("c_dec", cl.decode_body)
    cl.parse_response = timed("c_dec", cl.parse_response)
    orig = cl.ActionClient._request

    async def _request(self, *a, **k):
        t = time.perf_counter()
        try:
            return await orig(self, *a, **k)
        finally:
            cur["c_http"] = cur.get("c_http", 0.0) + (time.perf_counter() - t) * 1000.0
    cl.ActionClient._request = _request

    import wamkit.serve.ws_client as wc
    from wamkit.serve.ws_codec import CODECS

    import wamkit.protocol.shm as shm

    for codec in CODECS.values():
        codec.body = timed("c_enc", codec.body)
        codec.decode = timed("c_dec", codec.decode)
    wc.packb = timed("c_enc", wc.packb)                          # inline arrays
    shm.ShmSlots.pack = timed("c_enc", shm.ShmSlots.pack)        # arrays into a shared-memory slot
    wc.unpackb = timed("c_dec", wc.unpackb)


# --protocols -> (server.protocol, server.shm_arrays): "+shm" sends the arrays through shared memory
WIRE = {"http": ("wamkit", False), "openpi": ("openpi", False), "sglang-ws": ("sglang-ws", False),
        "sglang-ws+shm": ("sglang-ws", True)}


async def drive(worker, batches: list[int], requests: int, warmup: int, cur: dict, probe_path: Path,
                rows: dict[int, list[dict]], protocol: str = "http") -> None:
    from wamkit.eval.config import ServerOptions
    from wamkit.eval.inference import ServerInference

    inf = ServerInference(policy="fixed-cost", policy_args=POLICY_ARGS,
                          options=ServerOptions(**SERVER, protocol=WIRE[protocol][0], shm_arrays=WIRE[protocol][1]),
                          workers=[worker])
    await inf.start()
    obs = [make_obs(i) for i in range(16)]
    step = 0
    try:
        for b in batches:
            for r in range(warmup + requests):
                with open(probe_path) as f:
                    n_before = sum(1 for _ in f)
                cur.clear()
                seeds = [step * 64 + j for j in range(b)]
                t = time.perf_counter()
                await inf.predict(obs[:b], seeds)
                rtt = (time.perf_counter() - t) * 1000.0
                step += 1
                if protocol != "http":
                    recs = inf.client.last_timings
                    if r >= warmup:
                        rows.setdefault(b, []).append({
                            "rtt": rtt, "c_enc": cur.get("c_enc", 0.0), "c_dec": cur.get("c_dec", 0.0),
                            "compute": statistics.median(x["server"]["compute_ms"] for x in recs),
                            "queue": statistics.median(x["server"]["queue_ms"] for x in recs),
                            "frames": len(recs), "batches": len({x["server"]["t_start"] for x in recs})})
                    continue
                timing = inf.client.last_timings[0]["server"]
                srv = None
                for _ in range(200):   # the server writes its line once the response is sent
                    with open(probe_path) as f:
                        lines = f.readlines()
                    if len(lines) > n_before:
                        srv = json.loads(lines[-1])
                        break
                    await asyncio.sleep(0.001)
                if r < warmup or srv is None:
                    continue
                rows.setdefault(b, []).append({"rtt": rtt, **cur, "queue": timing["queue_ms"],
                                               "compute": timing["compute_ms"], **{"s_" + k: v for k, v in srv.items()}})
    finally:
        await inf.close()


def summarize(samples: list[dict]) -> dict[str, float]:
    def med(f):
        return statistics.median(f(s) for s in samples)
    return {
        "rtt": med(lambda s: s["rtt"]), "compute": med(lambda s: s["compute"]),
        "overhead": med(lambda s: s["rtt"] - s["compute"]),
        "c_enc": med(lambda s: s["c_enc"]), "s_recv": med(lambda s: s["s_recv"]), "s_dec": med(lambda s: s["s_dec"]),
        "s_hop": med(lambda s: s["s_handler"] - s["s_recv"] - s["s_dec"] - s["s_submit"] - s["s_resp"]),
        "queue": med(lambda s: s["queue"]), "s_batch": med(lambda s: s["s_submit"] - s["queue"] - s["compute"]),
        "s_resp": med(lambda s: s["s_resp"]), "c_dec": med(lambda s: s["c_dec"]),
        "http": med(lambda s: s["c_http"] - s["s_handler"]),
        "c_other": med(lambda s: s["rtt"] - s["c_enc"] - s["c_http"] - s["c_dec"]),
        "predict": med(lambda s: s["s_predict"]), "n": len(samples),
    }


COLS = ("rtt", "compute", "overhead", "c_enc", "s_recv", "s_dec", "s_hop", "queue", "s_batch", "s_resp", "c_dec",
        "http", "c_other", "predict")
HEAD = ("request size", "rtt", "compute", "**overhead**", "c.enc", "s.recv", "s.dec", "s.hop", "queue", "s.batch",
        "s.resp", "c.dec", "http", "c.other", "predict", "n")


def summarize_ws(samples: list[dict]) -> dict[str, float]:
    def med(k):
        return statistics.median(s[k] for s in samples)
    return {"rtt": med("rtt"), "compute": med("compute"),
            "overhead": statistics.median(s["rtt"] - s["compute"] for s in samples), "c_enc": med("c_enc"),
            "c_dec": med("c_dec"), "queue": med("queue"), "frames": med("frames"), "batches": med("batches"),
            "max_batches": max(s["batches"] for s in samples), "n": len(samples)}


WS_HEAD = ("request size", "rtt", "compute", "**overhead**", "c.enc", "c.dec", "queue", "frames", "batches (median / "
           "max)", "n")


def ws_table(results: dict[int, dict]) -> list[str]:
    lines = ["| " + " | ".join(WS_HEAD) + " |", "|" + "---:|" * len(WS_HEAD)]
    for b, s in results.items():
        lines.append(f"| {b} | {s['rtt']:.2f} | {s['compute']:.2f} | **{s['overhead']:.2f}** | {s['c_enc']:.2f} | "
                     f"{s['c_dec']:.2f} | {s['queue']:.2f} | {s['frames']:g} | {s['batches']:g} / "
                     f"{s['max_batches']:g} | {s['n']} |")
    return lines


def compare_table(protocols: list[str], batches: list[int], rows: dict, per_round: dict) -> list[str]:
    """Overhead per protocol side by side: the median over every request, then each round's median."""
    head = ["request size", *(f"{p} overhead" for p in protocols),
            *(f"{p} vs http" for p in protocols if p != "http" and "http" in protocols),
            *(f"{p} per round" for p in protocols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in batches:
        ov = {p: statistics.median(s["rtt"] - s["compute"] for s in rows[p][b]) for p in protocols if rows[p].get(b)}
        if len(ov) < len(protocols):
            continue
        cells = [str(b), *(f"{ov[p]:.2f}" for p in protocols)]
        if "http" in protocols:
            cells += [f"{(ov[p] / ov['http'] - 1) * 100:+.0f}%" for p in protocols if p != "http"]
        cells += [" / ".join(f"{v:.1f}" for v in per_round[p][b]) for p in protocols]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def table(results: dict[int, dict]) -> list[str]:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---:|" * len(HEAD)]
    for b, s in results.items():
        cells = [str(b)] + [f"**{s[c]:.2f}**" if c == "overhead" else f"{s[c]:.2f}" for c in COLS] + [str(s["n"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _dirty() -> bool:
    """Whether src/ has uncommitted changes (the figures then belong to no commit)."""
    return bool(os.popen(f"git -C {Path(__file__).parent} status --porcelain src").read().strip())


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_probe_serve":
        return _probe_serve(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=30, help="timed requests per request size and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all request sizes, each on a fresh server")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--protocols", default="http", help="comma-separated, of http, openpi, sglang-ws, sglang-ws+shm: "
                    "each through the client `wamkit eval` uses for it, on the same server, interleaved within every "
                    "round")
    ap.add_argument("--label", default="", help="a name for this run in the results file (e.g. before, after)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "request_overhead.md"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import cpu_model
    from wamkit.serve.workers import WamkitServerWorker

    class ProbeWorker(WamkitServerWorker):
        def command(self) -> list[str]:
            cmd = super().command()
            return [self.python, os.path.abspath(__file__), "_probe_serve", *cmd[cmd.index("serve") + 1:]]

    install_client_probe(cur := {})
    batches = [int(b) for b in args.batches.split(",")]
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    for p in protocols:
        if p not in WIRE:
            ap.error(f"--protocols: {p!r} is not one of {', '.join(WIRE)}")
    rows_by: dict[str, dict[int, list[dict]]] = {p: {} for p in protocols}
    per_round: dict[str, dict[int, list[float]]] = {p: {b: [] for b in batches} for p in protocols}
    load0 = os.getloadavg()[0]
    from wamkit.eval.config import ServerOptions
    from wamkit.eval.inference import start_server_workers

    for rnd in range(args.rounds):
        fd, probe = tempfile.mkstemp(prefix="wamkit-probe-", suffix=".jsonl")
        os.close(fd)
        # started as `wamkit eval` starts its servers (ServerOptions' defaults, e.g. its batching keys)
        opts = ServerOptions(**SERVER, serve_args={"log_every_s": 0}, shm_arrays=True)   # offered; used by +shm
        [w] = start_server_workers("fixed-cost", POLICY_ARGS, opts,
                                   lambda **kw: ProbeWorker(env={PROBE_ENV: probe}, **kw))
        try:
            order = batches if rnd % 2 == 0 else batches[::-1]
            for p in (protocols if rnd % 2 == 0 else protocols[::-1]):
                got: dict[int, list[dict]] = {}
                asyncio.run(drive(w, order, args.requests, args.warmup, cur, Path(probe), got, p))
                for b, samples in got.items():
                    rows_by[p].setdefault(b, []).extend(samples)
                    per_round[p][b].append(statistics.median(s["rtt"] - s["compute"] for s in samples))
        finally:
            w.stop()
        os.unlink(probe)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    tab: list[str] = []
    for p in protocols:
        rows = rows_by[p]
        if p == "http":
            part = table({b: summarize(rows[b]) for b in batches if rows.get(b)})
        else:
            part = ws_table({b: summarize_ws(rows[b]) for b in batches if rows.get(b)})
        if protocols != ["http"]:
            part = [f"**{p}** (server.protocol={WIRE[p]})", "", *part, ""]
        tab += part
    if len(protocols) > 1:
        tab += ["**overhead (rtt - compute) by protocol**: medians over every request; per round: each round's "
                "median, in the order the rounds ran", "", *compare_table(protocols, batches, rows_by, per_round)]
    print("\n".join(tab))
    cmd = "PYTHONPATH=src .venv/bin/python bench/bench_request_overhead.py " + " ".join(sys.argv[1:])
    head = [f"## {args.label or 'run'}: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}", "",
            f"- command: `{cmd.strip()}`",
            f"- machine: {cpu_model()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, load average "
            f"at start {load0:.1f}",
            f"- git: {os.popen('git -C ' + str(Path(__file__).parent) + ' rev-parse --short HEAD').read().strip()}"
            f"{' (+ uncommitted changes)' if _dirty() else ''}",
            "", *tab, ""]
    out = Path(args.out)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("# Per-request overhead of the action server (`bench/bench_request_overhead.py`)\n\n"
                       "One request in flight at a time, MetaWorld-shaped observations (camera `image` 224x224x3 "
                       "uint8, 39-D state, task), `wamkit serve policy=fixed-cost` (20 ms sleep per batch), "
                       "max_batch_size=64, max_wait_ms=2.0, client = `ServerInference` -> `ActionClient`. Medians "
                       "in ms; columns: the script's docstring.\n\n")
    with open(out, "a") as f:
        f.write("\n".join(head) + "\n")
    print(f"appended to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
