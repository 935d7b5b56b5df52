"""auto's planner against the fixed (B, P) grid, on modelled costs (bench/planner_sim.py): the real Scheduler and
RequestPlanner run on a virtual clock, so these numbers are exact and repeatable, independent of this machine's load."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import planner_sim as ps  # noqa: E402

# the regimes' spread between the best and the worst fixed row is wide (up to 6x), so a planner that picked a
# poor row would fall far below this line; auto's measured minimum over the regimes is 0.91 (bench/bench_planner.py)
AUTO_VS_BEST = 0.88


def _rows(r: ps.Regime) -> dict[str, dict]:
    return {label: ps.run(r, mode, b, p) for label, mode, b, p in ps.grid_rows(r)}


def test_model_is_exact_and_runs_every_episode_once():
    r = ps.REGIMES["gpu-metaworld-16"]
    a, b = ps.run(r, "auto"), ps.run(r, "auto")
    assert a == b                                   # virtual time: the same numbers every run
    assert a["episodes"] == r.episodes
    assert ps.run(r, "pipelines", 4, 4)["episodes"] == r.episodes


@pytest.mark.parametrize("name", sorted(ps.REGIMES))
def test_auto_is_not_slower_than_the_best_fixed_row(name):
    r = ps.REGIMES[name]
    rows = _rows(r)
    auto = rows.pop("auto")["env_steps_per_s"]
    best = max(x["env_steps_per_s"] for x in rows.values())
    worst = min(x["env_steps_per_s"] for x in rows.values())
    assert auto >= AUTO_VS_BEST * best, (name, auto, best)
    if worst < 0.7 * best:                           # a grid with poor rows: auto is far from them
        assert auto >= 1.3 * worst, (name, auto, worst)
    assert auto <= ps.bounds(r)["bound"] * 1.01     # the model's stage bound holds


def test_the_check_catches_a_poor_plan():
    """The same check fails for a schedule that ignores the costs (every observation sent alone, all in flight):
    the inference-bound regime punishes it ~6x."""
    r = ps.REGIMES["inference-bound-16"]
    rows = _rows(r)
    rows.pop("auto")
    best = max(x["env_steps_per_s"] for x in rows.values())
    naive = ps.run(r, "pipelines", 1, r.envs)["env_steps_per_s"]
    assert naive < 0.5 * AUTO_VS_BEST * best


def test_auto_follows_the_regime():
    """Where calls are expensive auto batches; where they are cheap it sends nearly every observation alone."""
    heavy = ps.run(ps.REGIMES["inference-bound-16"], "auto")
    light = ps.run(ps.REGIMES["sim-bound-8"], "auto")
    assert heavy["mean_batch"] >= 4 and light["mean_batch"] <= 2


def test_a_slower_accelerator_gets_larger_batches():
    r = ps.REGIMES["gpu-metaworld-16"]
    slow = dataclasses.replace(r, infer_a=3 * r.infer_a)
    assert ps.run(slow, "auto")["mean_batch"] > ps.run(r, "auto")["mean_batch"]


@pytest.mark.parametrize("mode,batch,pipelines", [("auto", 1, 1), ("pipelines", 2, 2), ("pipelines", 4, 1)])
def test_an_env_keeps_its_task_while_episodes_of_it_are_queued(mode, batch, pipelines):
    """Episodes go to the env that has their task loaded (LIBERO's soft reset keeps the scene), every planned
    episode runs exactly once, and an env changes task only when its task has nothing left in the queue."""
    import asyncio

    from wamkit.eval.plan import make_plan
    from wamkit.eval.scheduler import Scheduler, SchedulerOptions

    r = dataclasses.replace(ps.REGIMES["sim-bound-8"], envs=4, chunks=2)
    seen: dict[int, list[int]] = {}

    class Recording(ps.SimEnv):
        async def reset(self, task_id, trial):
            seen.setdefault(self.index, []).append(task_id)
            return await super().reset(task_id, trial)

    class Fifo(Scheduler):                                    # the plain order: head of the queue
        def _next_episode(self, i):
            return self.queue.popleft() if self.queue else None

    def run(cls):
        seen.clear()

        async def go():
            cores = asyncio.Semaphore(r.cores)
            envs = [Recording(i, r, cores) for i in range(r.envs)]
            done = []
            plan = make_plan("sim", [0, 1, 2], 7)             # 21 episodes, task-major
            opts = SchedulerOptions(mode=mode, request_size=batch, pipelines=pipelines, cores=r.cores,
                                    run_to_max_steps=True)
            await cls(envs, ps.SimAccelerator(r), plan, opts, done.append).run()
            return done

        done = ps.run_virtual(go())
        keys = [o.episode.key for o in done]
        assert len(keys) == 21 and len(set(keys)) == 21
        return sum(sum(a != b for a, b in zip(t, t[1:])) for t in seen.values()), dict(seen)

    fifo, _ = run(Fifo)
    switches, tasks = run(Scheduler)
    assert switches < fifo, (switches, fifo)
    assert switches <= len(tasks), tasks                     # about one task change per env at most
    for t in tasks.values():
        assert t == sorted(t)                                  # a task once left is never come back to


def test_envs_kept_from_an_earlier_run_start_on_the_task_they_have_loaded():
    import asyncio

    from wamkit.eval.plan import make_plan
    from wamkit.eval.scheduler import Scheduler, SchedulerOptions

    r = dataclasses.replace(ps.REGIMES["sim-bound-8"], envs=3, chunks=1)
    first: dict[int, int] = {}

    class Loaded(ps.SimEnv):
        async def reset(self, task_id, trial):
            first.setdefault(self.index, task_id)
            return await super().reset(task_id, trial)

    async def go():
        cores = asyncio.Semaphore(r.cores)
        envs = [Loaded(i, r, cores) for i in range(3)]
        for e, t in zip(envs, (2, 0, 1)):
            e.loaded_task = t
        opts = SchedulerOptions(mode="auto", cores=r.cores, run_to_max_steps=True)
        done = []
        await Scheduler(envs, ps.SimAccelerator(r), make_plan("sim", [0, 1, 2], 2), opts, done.append).run()
        return done

    done = ps.run_virtual(go())
    assert first == {0: 2, 1: 0, 2: 1} and len(done) == 6


def test_the_model_server_batches_queued_requests_like_wamkit_serve():
    """With server_wait_s set, the modelled accelerator merges requests queued while it is busy (one batch at a time,
    FIFO), as `wamkit serve`'s DynamicBatcher does: sixteen single-observation pipelines reach the server in batches
    above one, every observation is answered exactly once, and the accelerator is never busy longer than the run;
    without it each request is its own call."""
    r = ps.REGIMES["gpu-libero-16-s7"]
    assert r.server_wait_s is not None
    out = ps.run(r, "pipelines", 1, r.envs)
    batches = out["server_batches"]
    assert out["episodes"] == r.episodes
    assert out["mean_batch"] == 1.0                       # what the client sent
    observations = r.episodes * r.chunks                  # one observation per chunk, one request each
    assert sum(batches) == observations                   # every observation in exactly one server batch
    assert max(batches) > 1 and len(batches) < observations   # ... and the server merged some
    assert out["accelerator_busy"] <= 1.0
    lone = ps.run(ps.with_server_wait(r, None), "pipelines", 1, r.envs)
    assert lone["episodes"] == r.episodes and lone["server_batches"] == []


def test_the_servers_per_request_work_costs_many_small_requests_most():
    """req_s models the server's host work per request (one at a time, its event loop): on session 19's regime (calls
    cost more than chunks) it slows 32 single-observation pipelines far more than two requests of 16 a cycle, which
    pay it twice; every episode still runs once."""
    r = ps.REGIMES["gpu-metaworld-32-s19"]
    slow = ps.with_(r, req_s=0.002)
    small = [ps.run(x, "pipelines", 1, r.envs) for x in (r, slow)]
    large = [ps.run(x, "pipelines", r.envs // 2, 2) for x in (r, slow)]
    assert all(o["episodes"] == r.episodes for o in small + large)
    small_loss = small[1]["env_steps_per_s"] / small[0]["env_steps_per_s"]
    large_loss = large[1]["env_steps_per_s"] / large[0]["env_steps_per_s"]
    assert small_loss < 0.9 and large_loss > small_loss + 0.05, (small_loss, large_loss)


def test_envs_that_submit_at_the_same_instant_go_as_one_request():
    """Sixteen envs that reset at once (no reset cost) submit in the same instant: the planner decides once all of
    them have submitted, so the first request carries all sixteen (deciding on the first submit sent it alone and
    the 1 + 15 split lasted the whole run), and auto on gpu-metaworld-16 comes within 0.97 of the best fixed row
    (0.956 with the split)."""
    import asyncio

    from wamkit.eval.plan import make_plan
    from wamkit.eval.scheduler import Scheduler, SchedulerOptions

    r = ps.REGIMES["inference-bound-16"]

    async def go():
        cores = asyncio.Semaphore(r.cores)
        envs = [ps.SimEnv(i, r, cores) for i in range(r.envs)]
        opts = SchedulerOptions(mode="auto", cores=r.cores, run_to_max_steps=True, env_timeout_min_s=600)
        done = []
        sched = Scheduler(envs, ps.SimAccelerator(r), make_plan("sim", [0], r.episodes), opts, done.append)
        await sched.run()
        return list(sched.batcher.decisions), done

    decisions, done = ps.run_virtual(go())
    assert len(done) == r.episodes
    assert decisions[0] == (r.envs, 1)
    assert 1 not in {n for n, _ in decisions[: len(decisions) // 2]}   # no env left to go alone
    mw = ps.REGIMES["gpu-metaworld-16"]
    rows = _rows(mw)
    auto = rows.pop("auto")["env_steps_per_s"]
    assert auto >= 0.97 * max(x["env_steps_per_s"] for x in rows.values())


def test_padding_to_graph_buckets_costs_what_the_bucket_costs():
    """The model's accelerator pads a batch to its CUDA-graph bucket (wam-ref's graphs, config.graph_buckets): a
    batch of 9 costs the 16 graph's time. On a what-if regime whose calls cost in proportion to the batch (not wam-ref
    small's measured, nearly flat cost), the greedy row's merged batches fall between buckets and lose accelerator
    time that a graph at every size gives back, while a row whose batches are buckets (B=16, P=2) barely moves."""
    r = ps.Regime("proportional-32", 32, 16, 0.015, 0.0008, 0.0012, net_s=0.003, jitter=0.4, chunks=8, episodes=96,
                  server_wait_s=0.0, buckets=(1, 2, 4, 8, 16, 24, 32), task_cost=(0.7, 0.9, 1.1, 1.3))
    assert r.batch_cost(9) == pytest.approx(r.infer_a + 16 * r.infer_b) and r.batch_cost(16) == r.batch_cost(9)
    every = dataclasses.replace(r, buckets=())
    assert every.batch_cost(9) == pytest.approx(r.infer_a + 9 * r.infer_b)
    padded, exact = ps.run(r, "pipelines", 1, 32), ps.run(every, "pipelines", 1, 32)
    assert exact["env_steps_per_s"] > 1.1 * padded["env_steps_per_s"]
    halves_padded, halves_exact = ps.run(r, "pipelines", 16, 2), ps.run(every, "pipelines", 16, 2)
    assert halves_exact["env_steps_per_s"] == pytest.approx(halves_padded["env_steps_per_s"], rel=0.02)


@pytest.mark.parametrize("mode,batch,pipelines", [("auto", 1, 1), ("pipelines", 2, 2)])
def test_each_task_reports_its_own_pace(mode, batch, pipelines):
    """Every episode records its chunks and their seconds, so the summary gives each task's mean chunk: on a model
    whose three tasks simulate at 0.5x, 1x and 2x the base cost, the three paces come out in that ratio (within the
    model's chunk jitter, +-20% on each chunk, averaged over the task's chunks)."""
    from wamkit.eval.metrics import summarize

    r = dataclasses.replace(ps.REGIMES["sim-bound-8"], envs=4, cores=4, chunks=4, task_cost=(0.5, 1.0, 2.0))
    done = ps.run_tasks(r, 3, 4, mode=mode, batch=batch, pipelines=pipelines)["done"]
    assert len(done) == 12 and all(o.chunks == r.chunks for o in done)
    recs = [{"key": o.episode.key, "suite": "sim", "task_id": o.episode.task_id, "trial": o.episode.trial,
             "success": o.success, "steps": o.steps, "chunks": o.chunks, "sim_s": o.sim_s} for o in done]
    pace = {t: row["chunk_ms"] for t, row in summarize(recs, wall_s=1.0, config={}, versions={})["per_task"].items()}
    base = r.sim_s * 1000.0
    for t, factor in zip(("0", "1", "2"), r.task_cost):
        assert pace[t] == pytest.approx(base * factor, rel=0.12), (t, pace)
