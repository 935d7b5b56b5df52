"""auto / best fixed row over every modelled regime (bench/planner_sim.py), each with and without the server's own
batching (`wamkit serve`: 5 ms, / 4 in the regimes' time scale) and at two jitter levels: 40 cases, their minimum
and mean. A planner change is judged by these two figures and by the cases it loses.

    python bench/planner_sweep.py [--md bench/results/planner_sweep.md --label "what was run"]

--md appends the per-case table and the summary, under the label, to that file (the sweep's results:
bench/results/planner_sweep.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import planner_sim as ps  # noqa: E402

SERVER_WAIT_S = 0.00125


def sweep() -> dict[tuple, float]:
    res = {}
    for name, r0 in ps.REGIMES.items():
        for sw in ([None, SERVER_WAIT_S] if r0.server_wait_s is None else [r0.server_wait_s]):
            r = ps.with_server_wait(r0, sw)
            for jitter in (0.2, 0.15):
                rj = ps.with_(r, jitter=jitter)
                rows = {lab: ps.run(rj, m, b, p)["env_steps_per_s"] for lab, m, b, p in ps.grid_rows(rj)}
                best = max(v for k, v in rows.items() if k != "auto")
                res[(name, sw, jitter)] = rows["auto"] / best
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--md", default="", help="append the table and summary to this markdown file")
    ap.add_argument("--label", default="", help="the section's heading in --md")
    a = ap.parse_args()
    res = sweep()
    lines = []
    for (name, sw, jitter), v in res.items():
        server = "server batching" if sw is not None else "one call per request"
        print(f"{name:26s} {server:21s} jitter {jitter:.2f}  auto / best fixed {v:.3f}")
        lines.append(f"| {name} | {server} | {jitter:.2f} | {v:.3f} |")
    summary = f"{len(res)} cases: min {min(res.values()):.3f}, mean {sum(res.values()) / len(res):.4f}"
    print(summary)
    if a.md:
        with open(a.md, "a") as f:
            f.write(f"\n## {a.label or 'sweep'}\n\n{summary}\n\n| regime | server | jitter | auto / best fixed |\n"
                    f"|---|---|---|---|\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
