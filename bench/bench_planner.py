"""The scheduler's rows on modelled costs (bench/planner_sim.py): auto against every (B, P) with B x P = envs.

    python bench/bench_planner.py [regime ...] [--rounds 3] [--json out.json] [--server-wait S]

--server-wait S: every regime's server batches like `wamkit serve` (queued requests merged, one batch at a time, a
batch going once its oldest observation has waited S modelled seconds; overlapping calls then do not share the
accelerator); --server-wait none: no regime's server batches.

Times are modelled (asyncio sleeps), so the table depends on the scheduler's decisions, not on this machine's load."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from planner_sim import REGIMES, bounds, grid_rows, run, with_server_wait  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("regimes", nargs="*", default=list(REGIMES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default="")
    ap.add_argument("--server-wait", default="", help="seconds, or none (default: each regime's own)")
    a = ap.parse_args()
    report = {}
    for name in a.regimes:
        r = REGIMES[name]
        if a.server_wait:
            r = with_server_wait(r, None if a.server_wait == "none" else float(a.server_wait))
        b = bounds(r)
        rows = {}
        for _ in range(a.rounds):
            for label, mode, bb, p in grid_rows(r):
                rows.setdefault(label, []).append(run(r, mode, bb, p))
        med = {k: statistics.median(x["env_steps_per_s"] for x in v) for k, v in rows.items()}
        best_fixed = max(v for k, v in med.items() if k != "auto")
        server = "" if r.server_wait_s is None else f", server batching after {r.server_wait_s * 1e3:.2f} ms"
        print(f"\n{name}: envs {r.envs}, cores {r.cores}, chunk {r.sim_s * 1e3:.0f} ms, call "
              f"{r.infer_a * 1e3:.1f} + {r.infer_b * 1e3:.2f} n ms; bounds: sim {b['sim']:.0f}, accelerator "
              f"{b['accelerator']:.0f}, dependency {b['dependency']:.0f} env steps/s{server}")
        print(f"{'row':>12} {'env steps/s':>12} {'mean batch':>11} {'acc busy':>9} {'of bound':>9} {'/best fixed':>12}")
        for k, v in rows.items():
            mb = statistics.median(x["mean_batch"] for x in v)
            busy = statistics.median(x["accelerator_busy"] for x in v)
            print(f"{k:>12} {med[k]:12.0f} {mb:11.1f} {busy:9.2f} {med[k] / b['bound']:9.2f} "
                  f"{med[k] / best_fixed:12.2f}")
        report[name] = {"bounds": b, "rows": rows, "median": med, "auto_over_best_fixed": med["auto"] / best_fixed}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
