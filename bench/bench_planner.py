"""The scheduler's rows on modelled costs (bench/planner_sim.py): auto against every (B, P) with B x P = envs.

    python bench/bench_planner.py [regime ...] [--rounds 3] [--json out.json] [--server-wait S]
    python bench/bench_planner.py --transients [--json out.json]

--transients: auto's decision check (eval/shape_probe.py) under a 1 s slowdown of the simulators (chunks 1.5x or
2x) starting at 10 places between 1.5 and 6 s of gpu-metaworld-32-s16 (the probe's stretch): auto over the halves row
(B=16, P=2, the grid's best there) with the check off, on the drop alone, and on the drop with a rival cut short.

--buckets 1,2,4,8,16,24,32: every regime's accelerator pads a batch up to the next of these CUDA-graph buckets, as
wam-ref's graphs do (config.graph_buckets); --buckets none: every size its own graph. On the device (H100, session 26)
wam-ref small's call was nearly flat in the batch (8.0 ms at 1, 9.4 at 8, 10.9 at 16 alone; ~13 ms at 1-8 beside 16
envs' rendering), so the padding cost the evaluation nothing measurable there (docs/benchmarks.md 2).

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
from planner_sim import REGIMES, bounds, grid_rows, run, with_, with_server_wait  # noqa: E402

from wamkit.eval.shape_probe import ShapeProbe  # noqa: E402

CHECKS = {"off": (1.0, True), "drop alone": (ShapeProbe.CHECK_DROP, False),
          "drop + cut rival": (ShapeProbe.CHECK_DROP, True)}


def transients(json_path: str) -> None:
    r0 = REGIMES["gpu-metaworld-32-s16"]
    shares: dict[str, list[float]] = {k: [] for k in CHECKS}
    saved = ShapeProbe.CHECK_DROP, ShapeProbe.CHECK_NEEDS_CUT
    print(f"{'slowdown':>18} {'halves row':>11} " + " ".join(f"{k:>17}" for k in CHECKS) + "   (auto / halves row)")
    try:
        for factor in (1.5, 2.0):
            for k in range(10):
                start = 1.5 + 0.5 * k
                r = with_(r0, slow=(start, start + 1.0, factor))
                row = run(r, "pipelines", 16, 2)["env_steps_per_s"]
                line = []
                for name, (drop, cut) in CHECKS.items():
                    ShapeProbe.CHECK_DROP, ShapeProbe.CHECK_NEEDS_CUT = drop, cut
                    shares[name].append(run(r, "auto")["env_steps_per_s"] / row)
                    line.append(shares[name][-1])
                print(f"{f'x{factor} {start:.1f}-{start + 1:.1f} s':>18} {row:11.0f} "
                      + " ".join(f"{v:17.3f}" for v in line))
    finally:
        ShapeProbe.CHECK_DROP, ShapeProbe.CHECK_NEEDS_CUT = saved
    print(f"{'mean':>30} " + " ".join(f"{statistics.mean(v):17.4f}" for v in shares.values()))
    print(f"{'min':>30} " + " ".join(f"{min(v):17.4f}" for v in shares.values()))
    if json_path:
        Path(json_path).write_text(json.dumps(shares, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("regimes", nargs="*", default=list(REGIMES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default="")
    ap.add_argument("--server-wait", default="", help="seconds, or none (default: each regime's own)")
    ap.add_argument("--buckets", default="", help="comma list: every regime's accelerator pads a batch to these "
                    "CUDA-graph buckets; none: every batch size its own graph; default: each regime's own")
    ap.add_argument("--transients", action="store_true")
    a = ap.parse_args()
    if a.transients:
        return transients(a.json)
    report = {}
    for name in a.regimes:
        r = REGIMES[name]
        if a.server_wait:
            r = with_server_wait(r, None if a.server_wait == "none" else float(a.server_wait))
        if a.buckets:
            r = with_(r, buckets=() if a.buckets == "none" else tuple(int(b) for b in a.buckets.split(",")))
        b = bounds(r)
        rows = {}
        for _ in range(a.rounds):
            for label, mode, bb, p in grid_rows(r):
                rows.setdefault(label, []).append(run(r, mode, bb, p))
        med = {k: statistics.median(x["env_steps_per_s"] for x in v) for k, v in rows.items()}
        best_fixed = max(v for k, v in med.items() if k != "auto")
        server = "" if r.server_wait_s is None else f", server batching after {r.server_wait_s * 1e3:.2f} ms"
        padded = f" (n padded to a bucket of {','.join(map(str, r.buckets))})" if r.buckets else ""
        print(f"\n{name}: envs {r.envs}, cores {r.cores}, chunk {r.sim_s * 1e3:.0f} ms, call "
              f"{r.infer_a * 1e3:.1f} + {r.infer_b * 1e3:.2f} n ms{padded}; bounds: sim {b['sim']:.0f}, accelerator "
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
