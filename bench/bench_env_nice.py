"""What `env_nice` and `server.reserve_cpus` do for a process that wakes up for short host work beside simulators
that keep every CPU busy (core/cpu_pinning.py): the mechanism on this machine, not an evaluation's rate.

    python bench/bench_env_nice.py [--busy N] [--wakeups W] [--sleep-ms S] [--work-us U] [--json out.json]

A "server" loop sleeps S ms (its GPU call) and then spins U us (its host work per request), W times; N busy
processes (default 2 x this machine's CPUs: the envs) spin meanwhile. Reported: how much longer than S + U each
wake-up took (median, p90, p99, mean), with the busy processes
- absent (the floor),
- at niceness 0 (as started),
- at niceness 10 and 19 (`env_nice`),
- on every CPU but the last, the loop alone on the last (`server.reserve_cpus=1`).
Whole-process wall clock of each wake-up; results in docs/benchmarks.md 2."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from _common import write_cases_json  # noqa: E402  (bench/ is on sys.path when run as a script)


def _busy(nice: int, cpus: list[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.nice(nice)
    x = 0
    while True:
        x += 1


def _spin(us: float) -> None:
    t = time.perf_counter()
    while (time.perf_counter() - t) * 1e6 < us:
        pass


def _loop(wakeups: int, sleep_s: float, work_us: float) -> list[float]:
    late = []
    for _ in range(wakeups):
        t0 = time.perf_counter()
        time.sleep(sleep_s)
        _spin(work_us)
        late.append((time.perf_counter() - t0 - sleep_s - work_us * 1e-6) * 1e3)
    return late


def case(name: str, busy: int, nice: int | None, reserve: bool, a) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    env_cpus, own = (cpus[:-1], cpus[-1:]) if reserve else (None, None)
    procs = [] if nice is None else [mp.Process(target=_busy, args=(nice, env_cpus), daemon=True) for _ in range(busy)]
    for p in procs:
        p.start()
    saved = os.sched_getaffinity(0)
    try:
        if own:
            os.sched_setaffinity(0, own)
        time.sleep(0.3)
        late = sorted(_loop(a.wakeups, a.sleep_ms / 1e3, a.work_us))
    finally:
        os.sched_setaffinity(0, saved)
        for p in procs:
            p.kill()
            p.join()
    q = lambda f: late[min(len(late) - 1, int(f * len(late)))]   # noqa: E731
    r = {"case": name, "median_ms": statistics.median(late), "p90_ms": q(0.9), "p99_ms": q(0.99),
         "mean_ms": statistics.fmean(late)}
    print(f"{name:<44} late by median {r['median_ms']:.2f}  p90 {r['p90_ms']:.2f}  p99 {r['p99_ms']:.2f}  "
          f"mean {r['mean_ms']:.2f} ms", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ncpu = len(os.sched_getaffinity(0))
    ap.add_argument("--busy", type=int, default=2 * ncpu)
    ap.add_argument("--wakeups", type=int, default=2000)
    ap.add_argument("--sleep-ms", type=float, default=2.0)
    ap.add_argument("--work-us", type=float, default=300.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if ncpu < 2:
        raise SystemExit("needs >= 2 CPUs")
    rows = [case("no busy processes", a.busy, None, False, a),
            case(f"{a.busy} busy at niceness 0", a.busy, 0, False, a),
            case(f"{a.busy} busy at niceness 10 (env_nice=10)", a.busy, 10, False, a),
            case(f"{a.busy} busy at niceness 19 (env_nice=19)", a.busy, 19, False, a),
            case(f"{a.busy} busy off the last CPU (reserve_cpus=1)", a.busy, 0, True, a)]
    write_cases_json(a.json, {"args": vars(a)}, rows)


if __name__ == "__main__":
    main()
