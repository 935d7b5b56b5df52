"""Would grouping the tasks by pace pay? The planner model (bench/planner_sim.py) with MetaWorld's tasks simulating
at different paces (a chunk of 9.5 to 20.3 ms on the H100 machine: report.md's "Task pace" line) and a server
whose batch costs the same at any size.

A request that waits for a group of envs waits for the slowest task's chunk among them, so the cohort rows (B=8,
P=2; B=16, P=1) lose to the greedy row (B=1, P=16) when every task runs at once, as the affinity's spread has it.
Here the same rows run with the tasks taken in phases of similar pace (every env on the fastest tasks first, then the
middle ones, then the slowest; each env's first episode still spread, as the paces are not known before then), which
costs each env a scene load per phase.

    python bench/bench_pace.py [--json out.json]

Times are modelled (virtual time): the table depends on the scheduler's decisions only."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from planner_sim import REGIMES, affinity_rule, run, with_  # noqa: E402

from wamkit.eval.affinity import TaskAffinity  # noqa: E402

ROWS = [("B=1, P=16", "pipelines", 1, 16), ("B=8, P=2", "pipelines", 8, 2), ("B=16, P=1", "pipelines", 16, 1),
        ("auto", "auto", 1, 1)]


def phased(phases: list[set[int]]) -> type[TaskAffinity]:
    """An affinity that spreads each env's first episode, then runs the tasks phase by phase (an env stays on its
    task while the phase has episodes of it, else takes the phase's task with the most queued)."""

    class Phased(TaskAffinity):
        def start(self, queue, n_envs):
            super().start(queue, n_envs)
            self.phase, self.started = 0, collections.Counter()

        def next_episode(self, i, queue):
            if not queue:
                return None
            self.started[i] += 1
            if self.started[i] == 1:
                return super().next_episode(i, queue)
            while not any(e.task_id in phases[self.phase] for e in queue):
                self.phase += 1
            counts = collections.Counter(e.task_id for e in queue if e.task_id in phases[self.phase])
            task = self.scene.get(i) if self.scene.get(i) in counts else max(counts, key=counts.get)
            ep = next(e for e in queue if e.task_id == task)
            queue.remove(ep)
            return ep

    return Phased


def table(r, rule) -> dict[str, float]:
    with affinity_rule(rule):
        return {label: run(r, mode, b, p)["env_steps_per_s"] for label, mode, b, p in ROWS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    r8 = REGIMES["gpu-metaworld-16-s26"]
    # the ten paces of session 19's 32-env timelines (gpu-metaworld-32-s19) on the same 16-env machine
    r10 = with_(r8, task_cost=REGIMES["gpu-metaworld-32-s19"].task_cost)
    cases = [("8 tasks (s26)", r8, [{0, 1, 2, 3}, {4, 5}, {6, 7}]),
             ("10 tasks (s19 paces)", r10, [{0, 1, 2, 3}, {4, 5, 6}, {7, 8, 9}])]
    report = {}
    print(f"{'case':>22} {'order':>7} " + " ".join(f"{label:>10}" for label, *_ in ROWS) + "   auto / best spread row")
    for name, r, phases in cases:
        spread = table(r, TaskAffinity)
        by_pace = table(r, phased(phases))
        best = max(v for k, v in spread.items() if k != "auto")
        for how, t in (("spread", spread), ("by pace", by_pace)):
            print(f"{name:>22} {how:>7} " + " ".join(f"{v:10.0f}" for v in t.values()) + f"   {t['auto'] / best:.3f}")
        report[name] = {"spread": spread, "by_pace": by_pace}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
