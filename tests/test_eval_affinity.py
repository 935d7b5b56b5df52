"""Which task each env runs (eval/affinity.py): the start spread, keeping loaded scenes, switching only where it
pays; and on the virtual-time model (bench/planner_sim.py) running the real Scheduler with costly scene loads."""

import dataclasses
import sys
from pathlib import Path

import pytest

from wamkit.eval.affinity import assign, spread, worth_switching
from wamkit.eval.plan import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import planner_sim as ps  # noqa: E402


def test_spread_gives_every_task_an_env_then_follows_the_episodes_per_env():
    assert spread({0: 17, 1: 17, 2: 17, 3: 17}, 16) == {0: 4, 1: 4, 2: 4, 3: 4}
    assert spread({0: 30, 1: 10}, 4) == {0: 3, 1: 1}
    assert spread({0: 1, 1: 100}, 3) == {0: 1, 1: 2}          # every task one env while envs last
    assert sum(spread({0: 5, 1: 7, 2: 3}, 11).values()) == 11
    k = spread({0: 50, 1: 20, 2: 20}, 9)                     # the largest per-env share is as small as it can be
    assert max(c / k[t] for t, c in {0: 50, 1: 20, 2: 20}.items()) == pytest.approx(10.0)


def test_assign_moves_as_few_envs_off_their_loaded_scene_as_it_can():
    counts = {0: 8, 1: 8, 2: 8, 3: 8}
    loaded = {i: 0 for i in range(8)}                         # all eight envs on task 0 (e.g. the last row drained)
    out = assign(loaded, counts, 8)
    assert sorted(out.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sum(out[i] != loaded[i] for i in loaded) == 6      # two stay, six must load a scene
    balanced = {i: i % 4 for i in range(8)}
    assert assign(balanced, counts, 8) == balanced            # nothing moves when the scenes already fit
    fresh = assign({}, counts, 8)                             # no scene loaded anywhere: every env gets one
    assert sorted(fresh) == list(range(8)) and sorted(fresh.values()) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_switch_pays_only_when_the_envs_already_on_the_task_would_finish_later():
    assert worth_switching(3, 0, load_s=100.0, episode_s=1.0)       # nobody on it: always
    assert not worth_switching(1, 4, load_s=7.0, episode_s=4.5)     # one episode left, four envs on it
    assert not worth_switching(1, 4, load_s=0.0, episode_s=4.5)     # ... one of them frees up before a whole episode
    assert worth_switching(4, 1, load_s=0.05, episode_s=4.5)        # a cheap switch halves a queue
    assert worth_switching(12, 1, load_s=7.0, episode_s=4.5)        # a long queue on one env
    assert not worth_switching(3, 1, load_s=30.0, episode_s=4.5)    # ... unless the load outlasts it
    # a long queue shared by a few envs: one more halves it (a rounding error made this False once, and the env
    # stopped 50 s before the end of a modelled 500-episode run)
    assert worth_switching(24, 2, load_s=7.3, episode_s=6.2)


def test_envs_that_all_start_on_one_task_spread_at_the_start_not_mid_run():
    """Eight envs all holding task 0's scene, four tasks of 6 episodes: six envs load another task's scene at the
    start, and no env loads a scene after that (mid-run loads make the tail)."""
    r = dataclasses.replace(ps.REGIMES["sim-bound-8"], envs=8, chunks=3, load_s=1.0, reset_s=0.02)
    plan = make_plan("sim", [0, 1, 2, 3], 6)
    res = ps.run_tasks(r, 4, 6, loaded={i: 0 for i in range(8)})
    keys = [o.episode.key for o in res["done"]]
    assert sorted(keys) == sorted(ep.key for ep in plan)           # every episode exactly once
    assert sum(e.loads for e in res["envs"]) == 6
    assert res["sched"].affinity.loads == 6


def test_an_env_stops_rather_than_load_a_scene_for_a_queue_others_finish_sooner():
    """Loads far dearer than an episode: once its task runs out an env stops instead of loading the scene of a task
    that other envs are on; with nearly free loads it switches and helps. Every episode runs once either way."""
    plan = make_plan("sim", [0, 1], 9)      # 9 + 9 episodes on 3 envs: task 0 gets two, task 1 one
    for load, expect_more in ((40.0, False), (0.001, True)):
        r = dataclasses.replace(ps.REGIMES["sim-bound-8"], envs=3, cores=3, chunks=2, load_s=load, reset_s=0.001,
                                jitter=0.6)
        res = ps.run_tasks(r, 2, 9)
        assert sorted(o.episode.key for o in res["done"]) == sorted(ep.key for ep in plan)
        loads = sum(e.loads for e in res["envs"])
        if expect_more:
            assert loads > 3, loads                            # switched to help the task left with a queue
        else:
            assert loads == 3, loads                           # the 3 first loads only
            assert res["sched"].affinity.stopped                # someone stopped instead


def test_costly_loads_finish_sooner_with_the_rules_than_keep_until_empty():
    """The old rule (keep the task until its queue is empty, then take the task with most queued per env) against
    the new ones, from a lopsided start (all envs on task 0) with loads ~3 episodes long: the new run ends sooner."""
    r = dataclasses.replace(ps.REGIMES["sim-bound-8"], envs=8, chunks=4, load_s=2.5, reset_s=0.02)
    lopsided = {i: 0 for i in range(8)}
    new = ps.run_tasks(r, 4, 10, loaded=lopsided)
    with ps.affinity_rule(ps.KeepUntilEmpty):
        old = ps.run_tasks(r, 4, 10, loaded=lopsided)
    assert sorted(o.episode.key for o in old["done"]) == sorted(o.episode.key for o in new["done"])
    assert new["wall_s"] < old["wall_s"], (new["wall_s"], old["wall_s"])
    assert new["loads"] <= old["loads"]


def test_bench_rows_start_from_the_scenes_their_scheduler_assigns(tmp_path):
    """bench eval positions kept envs before each timed row (untimed): envs whose scene differs from the row's
    start assignment load it; envs that fit are left alone; serial rows and too few envs are left alone."""
    from rich.console import Console

    from wamkit.eval.bench import position_envs
    from wamkit.eval.config import EvalConfig

    class Worker:
        def __init__(self, t):
            self.loaded_task, self.tasks, self.calls = t, [object()] * 6, []

        def reset_sync(self, task, trial):
            self.calls.append((task, trial))
            self.loaded_task = task

    class Kept:
        def __init__(self, loaded):
            self.workers = [Worker(t) for t in loaded]

    cfg = EvalConfig(env="metaworld", tasks=[0, 1, 2, 3], trials=5, num_envs=8, mode="auto")
    kept = Kept([0] * 8)
    position_envs(cfg, kept, Console(file=open(tmp_path / "log", "w")))
    assert sorted(w.loaded_task for w in kept.workers) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sum(len(w.calls) for w in kept.workers) == 6
    before = [list(w.calls) for w in kept.workers]
    position_envs(cfg, kept, Console(file=open(tmp_path / "log", "w")))      # already positioned: no call
    assert [w.calls for w in kept.workers] == before
    # the scheduler of that row starts every env on the scene it has: no load at the start
    from wamkit.eval.affinity import TaskAffinity

    aff = TaskAffinity({i: w.loaded_task for i, w in enumerate(kept.workers)})
    aff.start(make_plan("sim", [0, 1, 2, 3], 5), 8)
    assert aff.env_task == {i: w.loaded_task for i, w in enumerate(kept.workers)}
    serial = Kept([0] * 8)
    position_envs(dataclasses.replace(cfg, mode="serial"), serial, Console(file=open(tmp_path / "log", "w")))
    assert not any(w.calls for w in serial.workers)


def test_single_batch_ratios_also_come_without_its_scene_loads():
    """The single-batch row (one env over every task) pays a scene load per task change inside its row: the report
    gives its rate without them and each row's ratio over that (the conservative one), beside the plain ratio."""
    from wamkit.eval.bench import add_ratios, markdown

    def fresh(loads, load_s):
        return [{"row": "single-batch", "env_steps_per_s": 30.0, "episodes_per_hour": 600.0, "wall_s": 40.0,
                 "env_steps": 1200.0, "scene_loads": loads, "scene_load_s": load_s, "episodes": 8,
                 "inference_obs_per_s": 2.0, "mean_batch": 1.0},
                {"row": "auto", "env_steps_per_s": 300.0, "episodes_per_hour": 6000.0, "wall_s": 40.0,
                 "env_steps": 12000.0, "scene_loads": 0, "scene_load_s": 0.0, "episodes": 64,
                 "inference_obs_per_s": 20.0, "mean_batch": 2.0}]

    rows = fresh(3, 10.0)
    sb, auto = rows
    add_ratios(rows, bound=None, contended=None)
    assert sb["env_steps_per_s_without_loads"] == 1200.0 / 30.0
    assert auto["ratio_steps"] == 10.0 and auto["ratio_steps_without_loads"] == 300.0 / 40.0
    text = markdown({"rows": rows, "bound": {"bound_env_steps_per_s": None}})
    assert "single-batch loaded 3 scene(s) in its row (10.0 s of 40.0 s): without them 40.0 env steps/s" in text
    assert "auto 7.50" in text
    no_loads = fresh(0, 0.0)
    add_ratios(no_loads, bound=None, contended=None)
    assert no_loads[1]["ratio_steps_without_loads"] is None and "without them" not in markdown(
        {"rows": no_loads, "bound": {"bound_env_steps_per_s": None}})
