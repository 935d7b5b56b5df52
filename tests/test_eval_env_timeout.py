"""A stalled env worker (hung simulator, SIGSTOP) does not hang the evaluation: past its deadline it is killed,
restarted and its episode re-run, as after a crash, and counted in the summary (scheduler.env_timeouts)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import numpy as np
import pytest

from wamkit.core.types import ChunkResult, Observation
from wamkit.eval.plan import make_plan
from wamkit.eval.scheduler import CallDeadlines, Scheduler, SchedulerOptions


def test_deadline_follows_the_slowest_measured_call_and_first_calls_get_the_allowance():
    d = CallDeadlines(min_s=1.0, factor=10.0, first_s=100.0)
    assert d.limit("execute", first=False) == 100.0          # nothing measured yet
    d.observe("execute", 0.05)
    assert d.limit("execute", first=False) == 1.0            # the floor
    d.observe("execute", 0.3)
    d.observe("execute", 0.2)
    assert d.limit("execute", first=False) == pytest.approx(3.0)   # 10 x the slowest
    assert d.limit("execute", first=True) == 100.0           # a fresh worker's first call
    assert d.limit("reset", first=False) == 100.0            # kinds are measured apart


class _Inference:
    max_request_size = 8
    latencies: list = []

    async def predict(self, observations, seeds):
        return [np.zeros((2, 4), np.float32) for _ in observations]


class _FakeEnv:
    """An env whose `stall_at`-th execute never answers (until killed); three chunks per episode."""

    def __init__(self, index: int, stall_at: int | None = None):
        self.index, self.stall_at = index, stall_at
        self.executes = self.kills = self.restarts = 0
        self.steps = 0

    def _obs(self):
        return Observation(images={}, state=np.zeros(4, np.float32), task="t")

    async def reset(self, task_id, trial):
        self.steps = 0
        return self._obs()

    async def execute(self, actions, render_every_step=False, run_to_max_steps=False):
        self.executes += 1
        if self.executes == self.stall_at:
            await asyncio.Event().wait()     # stalled: no answer, ever
        self.steps += len(actions)
        done = self.steps >= 6
        return ChunkResult(None if done else self._obs(), done, done, len(actions), self.steps)

    def kill(self):
        self.kills += 1

    def restart(self):
        self.restarts += 1


@pytest.mark.parametrize("mode", ["auto", "pipelines"])
def test_stalled_call_is_killed_restarted_and_its_episode_rerun(mode):
    envs = [_FakeEnv(0), _FakeEnv(1, stall_at=3)]
    done = []
    opts = SchedulerOptions(mode=mode, pipelines=2, env_timeout_min_s=0.2, env_timeout_first_s=0.2)
    sched = Scheduler(envs, _Inference(), make_plan("s", [0, 1], 3), opts, done.append)
    asyncio.run(asyncio.wait_for(sched.run(), 60))
    keys = [o.episode.key for o in done]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 6
    assert sched.env_timeouts == 1 and envs[1].kills == 1 and envs[1].restarts == 1 and envs[0].kills == 0
    assert sum(o.attempts > 1 for o in done) == 1


@pytest.mark.slow
@pytest.mark.metaworld
def test_sigstopped_env_worker_process_does_not_hang_the_eval(tmp_path):
    """A real env worker process SIGSTOPped in the middle of a chunk: the eval finishes, every episode once."""
    pytest.importorskip("metaworld")
    from wamkit.core.config import load_config
    from wamkit.envs.worker import EnvWorker
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.runner import run_eval

    stopped: list[int] = []

    class StallOnce(EnvWorker):
        calls = 0

        async def execute(self, *a, **kw):
            self.calls += 1
            if self.index == 1 and self.calls == 3 and not stopped:   # not a first call: the measured deadline
                os.kill(self.pid, signal.SIGSTOP)
                stopped.append(self.pid)
            return await super().execute(*a, **kw)

    out = tmp_path / "stall"
    cfg = load_config(EvalConfig, None, [
        "env=metaworld", "suite=mt", "env_args.tasks=reach-v3,drawer-open-v3", "trials=2", "image_size=32",
        "policy=metaworld-expert", "horizon=4", "max_steps=60", "progress=false", f"out={out}", "mode=auto",
        "num_envs=2", "env_timeout_min_s=3", "env_timeout_first_s=120"])
    s = run_eval(cfg, env_workers=lambda env, kw, n: [StallOnce(env, kw, index=i) for i in range(n)])
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    keys = [r["key"] for r in recs]
    assert stopped and len(keys) == 4 and len(set(keys)) == 4
    assert s["episodes"] == 4 and s["scheduler"]["env_timeouts"] == 1 and s["scheduler"]["env_restarts"] == 1
    assert sum(r["attempts"] > 1 for r in recs) == 1
    with pytest.raises(ProcessLookupError):   # the stopped process was killed, not left behind
        os.kill(stopped[0], 0)


class _PoisonResetEnv(_FakeEnv):
    """An env whose reset of trial 1 always crashes its worker (a simulator that dies on one init state)."""

    def __init__(self, index: int, fail_once: bool = False):
        super().__init__(index)
        self.fail_once, self.failed = fail_once, 0

    async def reset(self, task_id, trial):
        from wamkit.envs.worker import EnvWorkerCrashed

        if trial == 1 and not (self.fail_once and self.failed):
            self.failed += 1
            raise EnvWorkerCrashed(self.index, "reset killed the worker")
        return await super().reset(task_id, trial)


@pytest.mark.parametrize("mode", ["serial", "auto", "pipelines"])
def test_an_episode_whose_reset_always_crashes_its_env_stops_the_run_after_its_retries(mode):
    """A probe's finding: in mode=pipelines an episode whose reset crashed its env worker every time was put back
    on the queue and retried forever (158 restarts in 100 s), the group's other envs waiting for it. Every mode now
    counts a reset crash as an attempt: max_episode_retries retries, then EpisodeFailed names the episode; a reset
    that crashes once is retried and recorded with its attempts."""
    from wamkit.eval.scheduler import EpisodeFailed

    n = 1 if mode == "serial" else 2
    envs = [_PoisonResetEnv(i) for i in range(n)]
    opts = SchedulerOptions(mode=mode, pipelines=n, max_episode_retries=2)
    sched = Scheduler(envs, _Inference(), make_plan("s", [0], 3), opts, lambda o: None)
    with pytest.raises(EpisodeFailed, match=r"episode s/0/1 crashed its env worker 3 times"):
        asyncio.run(asyncio.wait_for(sched.run(), 60))
    assert sum(e.restarts for e in envs) == 2

    envs = [_PoisonResetEnv(i, fail_once=True) for i in range(n)]
    done = []
    sched = Scheduler(envs, _Inference(), make_plan("s", [0], 3), opts, done.append)
    asyncio.run(asyncio.wait_for(sched.run(), 60))
    assert sorted(o.episode.key for o in done) == ["s/0/0", "s/0/1", "s/0/2"]
    assert {o.episode.key: o.attempts for o in done}["s/0/1"] == 2


@pytest.mark.parametrize("bad, says", [
    (lambda n: np.full((n, 2, 4), np.nan, np.float32), "non-finite actions"),
    (lambda n: np.full((n, 2, 4), np.inf, np.float32), "non-finite actions"),
    (lambda n: np.zeros((n, 2, 5), np.float32), "shape [1, 2, 5]"),
    (lambda n: np.zeros((0, 2, 4), np.float32), "shape [0, 2, 4]")])
def test_unusable_actions_stop_the_run_naming_what_is_wrong(bad, says):
    """A probe's finding: NaN actions went into the simulator and the episodes counted as ordinary failures (a
    broken model looked like 0% success), inf was clipped without a word, a wrong shape failed later in the env
    worker with a long traceback, a short batch as an IndexError. Inference.predict checks every answer."""
    from wamkit.eval.inference import Inference, PolicyOutputError

    class Bad(Inference):
        name = "bad"

        async def _predict(self, observations, seeds):
            return bad(len(observations))

    inf = Bad()
    inf.action_dim = 4
    sched = Scheduler([_FakeEnv(0)], inf, make_plan("s", [0], 1), SchedulerOptions(mode="serial"), lambda o: None)
    with pytest.raises(PolicyOutputError, match=re.escape(says)):
        asyncio.run(asyncio.wait_for(sched.run(), 60))
