import json

import pytest

from wamkit.eval.journal import Journal
from wamkit.eval.metrics import summarize
from wamkit.eval.plan import Episode, make_plan, step_seed


def rec(key, task_id, trial, success, steps=10):
    return {"key": key, "suite": "s", "task_id": task_id, "trial": trial, "task": "t", "success": success,
            "steps": steps}


def test_plan_order_and_keys():
    plan = make_plan("libero_object", [2, 5], trials=3, instructions={2: "a", 5: "b"})
    assert [(e.task_id, e.trial) for e in plan] == [(2, 0), (2, 1), (2, 2), (5, 0), (5, 1), (5, 2)]
    assert [e.index for e in plan] == list(range(6))
    assert len({e.key for e in plan}) == 6 and plan[3].task == "b"


def test_step_seed_depends_on_episode_and_step_only():
    a = Episode(0, "s", 1, 2)
    b = Episode(7, "s", 1, 2)   # same episode at another plan position
    assert step_seed(0, a, 16) == step_seed(0, b, 16)
    assert step_seed(0, a, 16) != step_seed(0, a, 32)
    assert step_seed(0, a, 16) != step_seed(1, a, 16)


def test_journal_resume_skips_torn_and_duplicate_lines(tmp_path):
    p = tmp_path / "results.jsonl"
    j = Journal(p)
    j.append(rec("s/0/0", 0, 0, True))
    j.append(rec("s/0/1", 0, 1, False))
    with pytest.raises(RuntimeError):
        j.append(rec("s/0/1", 0, 1, False))
    j.close()
    with open(p, "a") as f:   # a duplicate and a torn line from a killed process
        f.write(json.dumps(rec("s/0/0", 0, 0, False)) + "\n")
        f.write('{"key": "s/0/2", "succ')
    j2 = Journal(p)
    assert set(j2.records) == {"s/0/0", "s/0/1"}
    assert j2.records["s/0/0"]["success"] is True   # the first record wins
    assert len(p.read_text().splitlines()) == 4       # loading alone changes nothing; tidy() sets lines aside
    j2.tidy()
    assert len(p.read_text().splitlines()) == 2


def test_summary_contract():
    recs = [rec("s/0/0", 0, 0, True, 50), rec("s/0/1", 0, 1, False, 100), rec("s/1/0", 1, 0, True, 30)]
    s = summarize(recs, wall_s=10.0, config={"a": 1}, versions={"mujoco": "x"}, inference_obs=20)
    assert (s["episodes"], s["successes"]) == (3, 2)
    assert s["success_rate"] == pytest.approx(2 / 3)
    assert s["per_task"]["0"] == {"task": "t", "episodes": 2, "successes": 1, "success_rate": 0.5,
                                  "mean_steps": 75.0}
    assert s["throughput"]["episodes_per_hour"] == pytest.approx(3 / 10 * 3600)
    assert s["throughput"]["env_steps_per_s"] == pytest.approx(18.0)
    assert s["throughput"]["inference_obs_per_s"] == pytest.approx(2.0)
    assert s["config"] == {"a": 1} and s["versions"] == {"mujoco": "x"}


def test_summary_gives_each_task_its_pace():
    """per_task chunk_ms: the task's chunk seconds over its chunks (all its episodes pooled); records without the
    fields (written before them) or with mistyped ones add nothing, and a task with none has no chunk_ms."""
    recs = [dict(rec("s/0/0", 0, 0, True), chunks=10, sim_s=0.2), dict(rec("s/0/1", 0, 1, False), chunks=30, sim_s=0.2),
            dict(rec("s/0/2", 0, 2, False), chunks="30", sim_s=9.0), dict(rec("s/0/3", 0, 3, False), chunks=True,
                                                                           sim_s=9.0),
            rec("s/1/0", 1, 0, True)]
    s = summarize(recs, wall_s=1.0, config={}, versions={})
    assert s["per_task"]["0"]["chunk_ms"] == pytest.approx(10.0)      # 0.4 s over 40 chunks
    assert s["per_task"]["0"]["episodes"] == 4
    assert "chunk_ms" not in s["per_task"]["1"] and "chunks" not in s["per_task"]["1"]


def test_auto_plan_follows_measured_costs():
    """The auto batcher's plan from measurements: a call far cheaper than a chunk -> every env its own request, all
    in flight (gathering a batch would only make envs wait); a call over a fifth of a chunk -> one batch of every
    env; inference whose cost grows with the batch (comparable to a chunk of simulation) -> cohorts that overlap
    (several requests in flight)."""
    import collections

    from wamkit.eval.scheduler import RequestPlanner

    class Inf:
        max_request_size = 64
        latencies: list = []

    def plan(a, b, s0, envs=4, cores=2):
        sched = type("S", (), {})()
        sched.inference = Inf()
        sched.inference.latencies = [(n, a + b * n) for n in (1, 2, 4, 8)]
        sched.opts = type("O", (), {"max_request_size": 0, "depth": 0, "cores": cores})()
        sched.sim_samples = collections.deque([(s0, 1)] * 5)
        sched.active_envs = envs
        return RequestPlanner(sched).plan()

    assert plan(a=0.001, b=0.0001, s0=1.0) == (1, 4)        # inference ~free: no batching, all in flight
    assert plan(a=0.3, b=0.0, s0=1.0, cores=4) == (4, 1)    # a call ~1/3 chunk: near-ties batch everyone
    n, k = plan(a=0.1, b=0.25, s0=1.0, envs=4, cores=4)     # batch of 4 = 1.1 s ~ one chunk of sim: overlap
    assert k >= 2 and n * k >= 4
    assert plan(a=1.0, b=0.0, s0=1.0, envs=4, cores=4) == (4, 1)   # fixed cost per batch: splitting gains nothing


def test_auto_waits_for_the_next_env_only_when_that_beats_another_call():
    """The auto batcher holds waiting observations for the next env predicted to finish its chunk only if it comes
    within straggler_wait(a, m) (a: the fixed cost of one inference call, m: observations waiting); an env far from
    done (or a cheap call) means: send now."""
    import collections
    import time

    from wamkit.eval.affinity import TaskAffinity
    from wamkit.eval.scheduler import RequestPlanner

    class Inf:
        max_request_size = 64
        latencies: list = []

    def deadline(a, started_ago, s0=1.0, waited=0.0, slot_free_ago=None, about_to_start=False, resetting=None,
                 first=False, loading=None):
        sched = type("S", (), {})()
        sched.inference = Inf()
        sched.inference.latencies = [(n, a + 0.001 * n) for n in (1, 2, 4)]
        sched.opts = type("O", (), {"max_request_size": 0, "depth": 0, "cores": 2})()
        sched.sim_samples = collections.deque([(s0, 1)] * 5)
        now = time.monotonic()
        # one env waiting, one simulating (started `started_ago`), or: one that just got its actions
        sched.sim_started = {} if about_to_start else {1: now - started_ago}
        sched.simulating = 0 if about_to_start else 1
        sched.active_envs = 2
        sched.reset_started, sched.reset_samples = {}, collections.deque()
        sched.affinity = TaskAffinity({})
        if resetting is not None:             # the other env is resetting: started `resetting[0]` ago, resets take [1]
            sched.sim_started, sched.simulating = {}, 1
            sched.reset_started, sched.reset_samples = {1: now - resetting[0]}, collections.deque([resetting[1]] * 3)
            if loading is not None:           # ... and builds another task's scene, loads taking `loading` s
                sched.affinity = TaskAffinity({}, loading)
                sched.affinity.reset_begun(1, 0)
                sched.affinity._loading[1] = now - resetting[0]
        if first:
            sched.inference.latencies = []
        ab = RequestPlanner(sched)
        ab.pending = [(None, 0, None, None, now - waited)]
        if slot_free_ago is not None:
            ab._slot_free_at = now - slot_free_ago
        return ab._deadline() - now

    w = RequestPlanner.straggler_wait(0.8, 1)                       # how long waiting is worth (0.48 s)
    assert 0.3 < w < 0.8
    assert RequestPlanner.straggler_wait(0.8, 15) < w               # the more waiting, the shorter the budget
    assert deadline(a=0.8, started_ago=0.1) <= 0.01                 # next env in ~0.9 s > w: send now
    assert deadline(a=0.8, started_ago=0.45) <= 0.01                # ~0.55 s away > w: send now
    m = RequestPlanner.ARRIVAL_MARGIN
    # ~0.3 s away: wait for it, plus a margin for a long chunk (1 s here), never past the budget
    assert deadline(a=0.8, started_ago=0.7) == pytest.approx(min(0.3 + m * 1.0 + 0.005, w), abs=0.02)
    assert deadline(a=0.8, started_ago=0.7, s0=0.8) == pytest.approx(min(0.1 + m * 0.8 + 0.005, w), abs=0.02)
    assert deadline(a=0.8, started_ago=0.7, waited=0.3) == pytest.approx(w - 0.3, abs=0.02)  # capped at arrival + w
    assert deadline(a=0.002, started_ago=0.6) <= 0.01               # cheap calls: never worth waiting
    # a reset under way ends about when the last ones took: 0.3 s from now here, worth waiting for
    assert deadline(a=0.8, started_ago=0, resetting=(0.2, 0.5)) == pytest.approx(min(0.3 + m * 1.0 + 0.005, w),
                                                                                 abs=0.02)
    assert deadline(a=0.8, started_ago=0, resetting=(0.0, 2.0)) <= 0.01        # 2 s away: send now
    # a reset that builds another task's scene ends as long as the loads done took, whatever the soft resets take
    assert deadline(a=0.8, started_ago=0, resetting=(0.2, 0.5), loading=2.0) <= 0.01
    assert deadline(a=0.8, started_ago=0, resetting=(0.0, 2.0), loading=0.3) == pytest.approx(
        min(0.3 + m * 1.0 + 0.005, w), abs=0.02)
    # the very first request (no call measured yet) waits for the other env's first reset
    assert deadline(a=0.8, started_ago=0, resetting=(0.0, 0.9), first=True) > 0.85
    # waiting for a request slot is not waiting to batch: the budget counts from when the slot came free
    assert deadline(a=0.8, started_ago=0.7, waited=0.9, slot_free_ago=0.0) == \
        pytest.approx(min(0.3 + m * 1.0 + 0.005, w), abs=0.02)
    # an env that just got its actions arrives a chunk from now (s0 = 0.3 s < w): worth waiting for
    assert deadline(a=0.8, started_ago=0, s0=0.3, waited=0.9, slot_free_ago=0.0, about_to_start=True) == \
        pytest.approx(0.3 + m * 0.3 + 0.005, abs=0.02)
