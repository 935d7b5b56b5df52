"""Why a server pinned while it runs needs PINNABLE_ENV (core/cpu_pinning.py): torch's CPU ops in a process whose
OpenMP team was sized for more CPUs than it is later pinned to.

    python bench/bench_omp_pin.py [--threads T] [--pin K] [--iters N] [--json out.json]

Each case is a fresh process that runs N x 3 small torch CPU ops (elementwise on a 16x3x64x64 tensor, each an
OpenMP parallel region) after a warm-up, with T torch threads (default: min(4, this machine's CPUs)):
- not pinned:                 every CPU;
- pinned while running:       warmed up on every CPU, then every thread pinned to K CPUs (default 1), as
                              `ServerWorker.set_cpus` does to bench eval's shared server for a row that reserves CPUs;
- pinned while running, PINNABLE_ENV: the same, started with OMP_WAIT_POLICY=PASSIVE;
- pinned from the start:      pinned to K CPUs before torch loads (the OpenMP runtime sizes its spinning for K),
                              with T threads, and with torch_threads() (min(4, K)).
Needs >= 2 CPUs. Whole-process timings of the timed loop only; results in docs/benchmarks.md 2."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _common import write_cases_json  # noqa: E402  (bench/ is on sys.path when run as a script)

from wamkit.core.cpu_pinning import PINNABLE_ENV

CHILD = r"""
import json, os, sys, time
pin, threads, iters, when = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cpus = sorted(os.sched_getaffinity(0))[-pin:]   # the last ones, as server.reserve_cpus gives
if when == "start":
    os.sched_setaffinity(0, cpus)
import torch
from wamkit.core.cpu_pinning import pin_process, torch_threads
torch.set_num_threads(threads if threads > 0 else torch_threads())
x = torch.randn(16, 3, 64, 64)
def work(n):
    for _ in range(n):
        (x * 0.5 + 1.0).clamp(0, 1).mean()
work(50)
if when == "running":
    pin_process(os.getpid(), cpus)
t = time.perf_counter(); work(iters); ms = (time.perf_counter() - t) * 1e3
print(json.dumps({"ms": ms, "threads": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0))}))
"""


def case(name: str, pin: int, threads: int, iters: int, when: str, env: dict[str, str] | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in PINNABLE_ENV}
    e.update(env or {})
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(pin), str(threads), str(iters), when], env=e,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"{name}: {out.stderr.strip()[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r.update(case=name, env=env or {}, process_s=round(time.perf_counter() - t0, 2))
    print(f"{name:<46} {r['threads']} thread(s) on {r['cpus']} CPU(s): {r['ms']:9.1f} ms "
          f"({r['ms'] * 1e3 / (3 * iters):7.1f} us a region)", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ncpu = len(os.sched_getaffinity(0))
    ap.add_argument("--threads", type=int, default=min(4, ncpu))
    ap.add_argument("--pin", type=int, default=1)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if ncpu < 2 or not 0 < a.pin < a.threads:
        raise SystemExit(f"needs >= 2 CPUs and 0 < --pin < --threads (CPUs {ncpu}, threads {a.threads}, pin {a.pin})")
    rows = [case("not pinned", ncpu, a.threads, a.iters, "never"),
            case("pinned while running", a.pin, a.threads, a.iters, "running"),
            case("pinned while running, PINNABLE_ENV", a.pin, a.threads, a.iters, "running", PINNABLE_ENV),
            case("pinned from the start", a.pin, a.threads, a.iters, "start"),
            case("pinned from the start, torch_threads()", a.pin, 0, a.iters, "start")]
    write_cases_json(a.json, {"threads": a.threads, "pin": a.pin, "iters": a.iters}, rows)


if __name__ == "__main__":
    main()
