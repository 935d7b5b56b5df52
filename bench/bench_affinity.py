"""Which env runs which task, on modelled LIBERO costs (bench/planner_sim.py, virtual time): the rules of
eval/affinity.py against the rule before them (keep the task until its queue is empty, then always switch), from
three start states, for auto and fixed (B, P) rows.

    python bench/bench_affinity.py [--json out.json]     (~1 min; results: bench/results/affinity.md)

Costs: the H200 LIBERO calls of session 6 (docs/benchmarks.md 2a), divided by 4 like the other modelled regimes: a
chunk 0.55 s with 16 envs busy (16 x 34.6 ms), a soft reset 0.3 s, a scene load 7 s, 10 chunks per episode, a call
30 ms + 0.8 ms per observation, several calls overlapping on the GPU. Start states: `warm` (envs spread over the tasks,
what bench eval's warm-up gives its first row), `inherited` (the scenes a previous row left: here 3 of 4 tasks with
the envs lopsided over them), `fresh` (no scene loaded: a new `wamkit eval`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from planner_sim import KeepUntilEmpty, Regime, affinity_rule, run_tasks  # noqa: E402

SCALE = 4.0


def regime(envs: int, cores: int) -> Regime:
    return Regime(f"libero-h200-{envs}", envs, cores, 0.55 / SCALE, 0.030 / SCALE, 0.0008 / SCALE,
                  reset_s=0.3 / SCALE, load_s=7.0 / SCALE, chunks=10, share_gain=0.5)


def starts(envs: int, tasks: int) -> dict[str, dict[int, int]]:
    lopsided = [0, 0, 0, 1, 1, 2] * envs
    return {"warm": {i: i % tasks for i in range(envs)},
            "inherited": {i: lopsided[i] for i in range(envs)},
            "fresh": {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    out = []
    for envs, cores, trials in ((16, 16, 16), (16, 16, 17), (32, 20, 16), (32, 20, 17)):
        r = regime(envs, cores)
        rows = [("auto", "auto", 1, 1), (f"B=1, P={envs}", "pipelines", 1, envs),
                (f"B={envs // 4}, P=4", "pipelines", envs // 4, 4)]
        print(f"\n{envs} envs on {cores} cores, 4 tasks x {trials} trials ({4 * trials} episodes; modelled s x "
              f"{SCALE:g})")
        print(f"{'row':>12} {'start':>10} {'old s':>7} {'old loads':>9} {'new s':>7} {'new loads':>9} {'new/old':>8}")
        for label, mode, b, p in rows:
            for name, loaded in starts(envs, 4).items():
                new = run_tasks(r, 4, trials, mode, b, p, loaded)
                with affinity_rule(KeepUntilEmpty):
                    old = run_tasks(r, 4, trials, mode, b, p, loaded)
                assert sorted(o.episode.key for o in new["done"]) == sorted(o.episode.key for o in old["done"])
                speed = new["env_steps_per_s"] / old["env_steps_per_s"]
                print(f"{label:>12} {name:>10} {old['wall_s'] * SCALE:7.1f} {old['loads']:9d} "
                      f"{new['wall_s'] * SCALE:7.1f} {new['loads']:9d} {speed:8.2f}x")
                out.append({"envs": envs, "trials": trials, "row": label, "start": name,
                            "old_wall_s": old["wall_s"] * SCALE, "old_loads": old["loads"],
                            "new_wall_s": new["wall_s"] * SCALE, "new_loads": new["loads"], "speedup": speed})
    # a whole suite as `wamkit eval` runs it: LIBERO-10's 10 tasks x 50 trials from fresh envs
    print(f"\nlibero_10 as a whole (10 tasks x 50 trials, fresh envs; modelled s x {SCALE:g})")
    print(f"{'envs':>5} {'row':>12} {'old s':>7} {'old loads':>9} {'new s':>7} {'new loads':>9} {'new/old':>8}")
    for envs, cores in ((16, 16), (32, 20)):
        r = regime(envs, cores)
        for label, mode, b, p in (("auto", "auto", 1, 1), (f"B=1, P={envs}", "pipelines", 1, envs)):
            new = run_tasks(r, 10, 50, mode, b, p)
            with affinity_rule(KeepUntilEmpty):
                old = run_tasks(r, 10, 50, mode, b, p)
            speed = new["env_steps_per_s"] / old["env_steps_per_s"]
            print(f"{envs:5d} {label:>12} {old['wall_s'] * SCALE:7.1f} {old['loads']:9d} {new['wall_s'] * SCALE:7.1f} "
                  f"{new['loads']:9d} {speed:8.2f}x")
            out.append({"envs": envs, "trials": 50, "tasks": 10, "row": label, "start": "fresh",
                        "old_wall_s": old["wall_s"] * SCALE, "old_loads": old["loads"],
                        "new_wall_s": new["wall_s"] * SCALE, "new_loads": new["loads"], "speedup": speed})
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
