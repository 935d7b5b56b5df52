"""A cost model of an evaluation for the scheduler's planner: envs that cost a fixed simulation time per chunk on C
cores, and one accelerator that runs one batch at a time in a + b*n seconds. The real Scheduler runs on it (its
modes, the RequestPlanner, the same code as `wamkit eval`); only time is modelled: the event loop runs on a virtual
clock that jumps to the next timer whenever nothing is ready (the scheduler's own clock reads are pointed at it), so
a run of thousands of chunks takes well under a second, gives the same numbers every time, and does not depend on
how busy this machine is.

Used by bench/bench_planner.py (the table over regimes) and tests/test_scheduler_planner.py (auto is never the slow
choice)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import selectors
from dataclasses import dataclass

import numpy as np

from wamkit.core.types import ChunkResult, Observation
from wamkit.eval import affinity as affinity_mod
from wamkit.eval import inference as inference_mod
from wamkit.eval import scheduler as scheduler_mod
from wamkit.eval.inference import Inference
from wamkit.eval.plan import make_plan
from wamkit.eval.scheduler import Scheduler, SchedulerOptions
from wamkit.policies.wam_ref.config import bucket_for


class _VirtualSelector(selectors.BaseSelector):
    """No real I/O: select(timeout) advances the loop's virtual clock by timeout and reports nothing ready."""

    def __init__(self, loop: "VirtualTimeLoop"):
        self.loop = loop
        self._keys: dict = {}

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._keys.pop(fileobj)

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("virtual-time loop: nothing scheduled and nothing ready (a deadlock in the model)")
        self.loop.now += max(0.0, timeout)
        return []

    def close(self):
        self._keys.clear()

    def get_map(self):
        return self._keys


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self.now = 0.0
        super().__init__(selector=_VirtualSelector(self))

    def time(self) -> float:
        return self.now


class _Clock:
    """Stands in for the `time` module inside the scheduler, affinity and inference modules while a model runs."""

    def __init__(self, loop: VirtualTimeLoop):
        self.loop = loop

    def monotonic(self) -> float:
        return self.loop.now

    def perf_counter(self) -> float:
        return self.loop.now

    def time(self) -> float:
        return 1.7e9 + self.loop.now


@contextlib.contextmanager
def _virtual_clock(loop: VirtualTimeLoop):
    saved = scheduler_mod.time, inference_mod.time, affinity_mod.time
    scheduler_mod.time = inference_mod.time = affinity_mod.time = _Clock(loop)
    try:
        yield
    finally:
        scheduler_mod.time, inference_mod.time, affinity_mod.time = saved


@dataclass(frozen=True)
class Regime:
    name: str
    envs: int
    cores: int
    sim_s: float          # one env's simulation time per chunk on a free core
    infer_a: float        # accelerator time per batch: a + b * n
    infer_b: float
    net_s: float = 0.002  # transport each way, overlapping other requests
    net_b: float = 0.0    # + this per observation each way (encoding, copying and sending the images)
    jitter: float = 0.2   # chunk time x U(1 - jitter, 1 + jitter)
    reset_s: float = 0.0
    load_s: float = 0.0   # a reset to another task than the env's loaded one (LIBERO builds the scene: a load)
    chunks: int = 6       # chunks per episode (run to max steps)
    episodes: int = 64
    horizon: int = 16
    max_batch: int = 64
    share_gain: float = 0.0  # 0: one batch at a time; g > 0: c overlapping calls run at (1 + g (c - 1)) / c speed each
                             # (a GPU running small batches from several threads: the H200 runs ~2.6x more b=1 calls
                             # per second with ~4 in flight than one at a time, so g ~ 0.5 there)
    task_cost: tuple[float, ...] = (1.0,)  # one factor per task on sim_s (MetaWorld's tasks simulate at different
                             # speeds: an env's chunks cost its task's factor); the plan has one task per factor
    server_wait_s: float | None = None  # None: each request is its own batch. A number: the server batches like
                             # `wamkit serve`'s DynamicBatcher: requests queue, one batch runs at a time, and a batch
                             # takes every queued observation (up to max_batch) once its oldest has waited this long
    req_s: float = 0.0    # the server's own host work per request (receive, decode, reply), one request at a time
                          # (its one event loop): many small requests queue here, one large one pays it once
    slow: tuple[float, float, float] = ()  # (start_s, end_s, factor): chunks that start in that stretch of the run
                             # cost `factor` times more (a transient: the host busy with something else for a while)
    buckets: tuple[int, ...] = ()  # the model's CUDA-graph batch buckets: a batch of n costs a + b * (the smallest
                             # bucket >= n), padded as wam-ref's graphs are; (): every size its own graph

    def batch_cost(self, n: int) -> float:
        """Accelerator seconds of one batch of n observations (padded up to a bucket where there are buckets)."""
        return self.infer_a + self.infer_b * bucket_for(self.buckets, n)


class SimEnv:
    """An env worker whose chunks cost sim_s (jittered, seeded per env and chunk) on one of `cores` cores."""

    def __init__(self, index: int, r: Regime, cores: asyncio.Semaphore):
        self.index, self.r, self.cores = index, r, cores
        self.rng = random.Random(1000 + index)
        self.steps = 0
        self.loaded_task = None
        self.loads = 0
        self.load_s = None    # like EnvWorker.load_s: the last scene load's seconds (the scheduler's first estimate)

    def _obs(self) -> Observation:
        return Observation(images={}, state=np.zeros(4, np.float32), task="t")

    async def _busy(self, seconds: float) -> None:
        async with self.cores:
            await asyncio.sleep(seconds)

    async def reset(self, task_id, trial):
        self.steps = 0
        cost = self.r.reset_s
        if self.loaded_task != task_id:
            cost, self.loads = cost + self.r.load_s, self.loads + 1
            self.load_s = float(cost)
        self.loaded_task = task_id
        if cost:
            await self._busy(cost)
        return self._obs()

    async def execute(self, actions, render_every_step=False, run_to_max_steps=False):
        j = self.r.jitter
        f = self.r.task_cost[(self.loaded_task or 0) % len(self.r.task_cost)]
        if self.r.slow and self.r.slow[0] <= asyncio.get_running_loop().time() < self.r.slow[1]:
            f *= self.r.slow[2]   # the virtual clock starts at 0 with the run
        await self._busy(self.r.sim_s * f * self.rng.uniform(1 - j, 1 + j))
        self.steps += len(actions)
        done = self.steps >= self.r.chunks * self.r.horizon
        return ChunkResult(None if done else self._obs(), False, done, len(actions), self.steps)

    def kill(self):
        pass

    def restart(self):
        pass


class SimAccelerator(Inference):
    """One device: a batch of n needs a + b * n seconds of it, plus transport each way (not serialized). With
    share_gain 0 it runs one batch at a time (FIFO); with g > 0 overlapping calls share it (processor sharing at
    total speed 1 + g (c - 1) for c calls)."""

    name = "sim"

    def __init__(self, r: Regime):
        super().__init__()
        self.r = r
        self.max_request_size = r.max_batch
        self.busy_s = 0.0
        self._lock: asyncio.Lock | None = None
        self._intake: asyncio.Lock | None = None
        self._calls: dict[int, list] = {}   # id -> [work left, future]
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._queue: list = []            # server batching: (observations, arrival, future) waiting
        self._runner: asyncio.Task | None = None
        self.batch_sizes: list[int] = []   # the server's batches (server batching)
        self.merges_requests = r.server_wait_s is not None

    async def _predict(self, observations, seeds):
        net = self.r.net_s + self.r.net_b * len(observations)
        await asyncio.sleep(net)
        if self.r.req_s > 0:   # the server's event loop takes the request in, one at a time
            if self._intake is None:
                self._intake = asyncio.Lock()
            async with self._intake:
                await asyncio.sleep(self.r.req_s)
        t = self.r.batch_cost(len(observations))
        if self.r.server_wait_s is not None:
            await self._batched(len(observations))
        elif self.r.share_gain > 0:
            await self._shared(t)
        else:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                await asyncio.sleep(t)
                self.busy_s += t
        await asyncio.sleep(net)
        return np.zeros((len(observations), self.r.horizon, 4), np.float32)

    # server-side dynamic batching on the virtual clock
    async def _batched(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((n, loop.time(), fut))
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run_batches())
        await fut

    async def _run_batches(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            waited = loop.time() - self._queue[0][1]
            queued = sum(n for n, _, _ in self._queue)
            if queued < self.r.max_batch and waited < self.r.server_wait_s - 1e-9:
                await asyncio.sleep(self.r.server_wait_s - waited)
                continue
            take, total = [], 0
            while self._queue and total + self._queue[0][0] <= self.r.max_batch:
                item = self._queue.pop(0)
                take.append(item)
                total += item[0]
            t = self.r.batch_cost(total)
            await asyncio.sleep(t)
            self.busy_s += t
            self.batch_sizes.append(total)
            for _, _, f in take:
                f.set_result(None)

    # processor sharing on the virtual clock
    def _speed(self) -> float:
        c = len(self._calls)
        return (1 + self.r.share_gain * (c - 1)) / c if c else 0.0

    def _advance(self, loop) -> None:
        now = loop.time()
        if self._calls:
            self.busy_s += now - self._last
            done = (now - self._last) * self._speed()
            for c in self._calls.values():
                c[0] -= done
        self._last = now

    def _reschedule(self, loop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._calls:
            left = min(c[0] for c in self._calls.values())
            self._timer = loop.call_at(loop.time() + max(0.0, left) / self._speed(), self._finish, loop)

    def _finish(self, loop) -> None:
        self._timer = None
        self._advance(loop)
        for k in [k for k, c in self._calls.items() if c[0] <= 1e-9]:
            self._calls.pop(k)[1].set_result(None)
        self._reschedule(loop)

    async def _shared(self, work: float) -> None:
        loop = asyncio.get_running_loop()
        self._advance(loop)
        fut = loop.create_future()
        self._calls[id(fut)] = [work, fut]
        self._reschedule(loop)
        await fut


def _options(r: Regime, mode: str, batch: int, pipelines: int, shapes: tuple[str, ...] | None) -> SchedulerOptions:
    """The scheduler's options for a modelled run (episodes run to max steps, no deadline the model could hit)."""
    return SchedulerOptions(mode=mode, request_size=batch, pipelines=pipelines, cores=r.cores, run_to_max_steps=True,
                            env_timeout_min_s=600, **({"shapes": shapes} if shapes else {}))


def run(r: Regime, mode: str, batch: int = 1, pipelines: int = 1, shapes: tuple[str, ...] | None = None) -> dict:
    """One evaluation of the regime's plan under one schedule: env steps/s, mean batch, episodes done (shapes: the
    ones auto measures, SchedulerOptions.shapes; None: all)."""

    async def go():
        cores = asyncio.Semaphore(r.cores)
        n = 1 if mode == "serial" else r.envs
        envs = [SimEnv(i, r, cores) for i in range(n)]
        inf = SimAccelerator(r)
        done = []
        sched = Scheduler(envs, inf, make_plan("sim", list(range(len(r.task_cost))), r.episodes // len(r.task_cost)),
                          _options(r, mode, batch, pipelines, shapes), done.append)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await sched.run()
        wall = loop.time() - t0
        steps = sum(o.env_steps for o in done)
        return {"mode": mode, "batch": batch, "pipelines": pipelines, "episodes": len(done), "wall_s": wall,
                "env_steps_per_s": steps / wall, "mean_batch": inf.observations / max(1, inf.requests),
                "accelerator_busy": inf.busy_s / wall, "server_batches": list(inf.batch_sizes),
                "auto_shape": sched.batcher.shape_summary() if sched.batcher is not None else None}

    return run_virtual(go())


class KeepUntilEmpty(affinity_mod.TaskAffinity):
    """The rule before session 6, for comparison: no spread at the start, keep the task until its queue is empty,
    then always take the task with the most queued episodes per env (never stop)."""

    def start(self, queue, n_envs):
        pass

    def load_estimate(self):
        return None


@contextlib.contextmanager
def affinity_rule(cls):
    """Run the Scheduler with another TaskAffinity class (KeepUntilEmpty: the old rule)."""
    saved = scheduler_mod.TaskAffinity
    scheduler_mod.TaskAffinity = cls
    try:
        yield
    finally:
        scheduler_mod.TaskAffinity = saved


def run_tasks(r: Regime, tasks: int, trials: int, mode: str = "auto", batch: int = 1, pipelines: int = 1,
              loaded: dict[int, int] | None = None, shapes: tuple[str, ...] | None = None) -> dict:
    """The regime over a plan of `tasks` x `trials` (task-major), envs starting with `loaded` scenes: env steps/s,
    scene loads, which env ran what (shapes: as in run)."""

    async def go():
        cores = asyncio.Semaphore(r.cores)
        envs = [SimEnv(i, r, cores) for i in range(r.envs)]
        for i, t in (loaded or {}).items():
            envs[i].loaded_task, envs[i].load_s = t, float(r.load_s + r.reset_s)   # loaded before the run
        inf = SimAccelerator(r)
        done = []
        sched = Scheduler(envs, inf, make_plan("sim", list(range(tasks)), trials),
                          _options(r, mode, batch, pipelines, shapes), done.append)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await sched.run()
        wall = loop.time() - t0
        return {"wall_s": wall, "env_steps_per_s": sum(o.env_steps for o in done) / wall, "episodes": len(done),
                "loads": sum(e.loads for e in envs), "done": done, "envs": envs, "sched": sched}

    return run_virtual(go())


def run_virtual(coro):
    """Run a coroutine to completion on a fresh virtual-time loop, the scheduler's clock reads pointed at it."""
    loop = VirtualTimeLoop()
    try:
        with _virtual_clock(loop):
            return loop.run_until_complete(coro)
    finally:
        loop.close()


def grid_rows(r: Regime) -> list[tuple[str, str, int, int]]:
    rows = [(f"B={r.envs // p}, P={p}", "pipelines", r.envs // p, p) for p in range(1, r.envs + 1) if r.envs % p == 0]
    return rows + [("auto", "auto", 1, 1)]


def bounds(r: Regime) -> dict:
    """Stage bounds in env steps/s: simulation alone (cores), the accelerator alone at its best batch, and the
    dependency bound (each env waits for its own batch: envs x horizon / (chunk + one call at batch 1))."""
    per_chunk = r.sim_s + r.reset_s / r.chunks          # a reset every `chunks` chunks
    sim = min(r.envs, r.cores) * r.horizon / per_chunk
    acc = r.max_batch * r.horizon / (r.infer_a + r.infer_b * r.max_batch)
    dep = r.envs * r.horizon / (per_chunk + r.infer_a + r.infer_b + 2 * (r.net_s + r.net_b))
    return {"sim": sim, "accelerator": acc, "dependency": dep, "bound": min(sim, acc, dep)}


REGIMES = {
    # the H200 MetaWorld run of issue 19 (16 envs, 16 cores, chunk ~160 ms, wam-ref small ~50 ms + 1.5 ms/obs) / 4
    "gpu-metaworld-16": Regime("gpu-metaworld-16", 16, 16, 0.040, 0.0125, 0.0004),
    "gpu-metaworld-32": Regime("gpu-metaworld-32", 32, 16, 0.040, 0.0125, 0.0004),
    # the CPU Cosmos3 run (2 envs on 2 cores, chunk ~1.7 s, 800 ms + 20 ms/obs) / 20
    "cpu-cosmos3-2": Regime("cpu-cosmos3-2", 2, 2, 0.085, 0.040, 0.001, episodes=16),
    # the same after LIBERO's soft reset (session 5): a chunk ~0.4 s against the 0.82 s call: inference-bound / 20
    "cpu-cosmos3-2-soft": Regime("cpu-cosmos3-2-soft", 2, 2, 0.0208, 0.0405, 0.001, net_s=0.0004, jitter=0.05,
                                 episodes=16),
    # inference-heavy: a call costs as much as a chunk
    "inference-bound-16": Regime("inference-bound-16", 16, 16, 0.030, 0.030, 0.001),
    # the H200 LIBERO run (16 envs, chunk 16 x 15.5 ms, a reset of ~4.5 s every 10 chunks, b=1 calls ~45 ms that
    # overlap on the GPU) / 4
    "gpu-libero-16": Regime("gpu-libero-16", 16, 16, 0.062, 0.011, 0.00015, reset_s=1.1, chunks=10,
                            share_gain=0.5),
    # the H200 LIBERO table of session 6 (16 envs: chunk 16 x 34.6 ms with 16 envs busy, soft resets ~0.3 s, calls
    # ~30 ms nearly flat in batch size and overlapping on the GPU) / 4
    "gpu-libero-16-s6": Regime("gpu-libero-16-s6", 16, 16, 0.1375, 0.0075, 0.00005, reset_s=0.075, chunks=10,
                               share_gain=0.5),
    # the H200 LIBERO table of session 7 (16 envs, after the task-affinity fix: chunk 16 x ~30 ms with 16 envs busy,
    # soft resets ~0.3 s, calls ~27-30 ms flat in batch size plus ~16 ms of HTTP each; wamkit serve batches queued
    # requests, one batch at a time, after 5 ms) / 4
    "gpu-libero-16-s7": Regime("gpu-libero-16-s7", 16, 16, 0.12, 0.007, 0.00005, net_s=0.002, reset_s=0.075,
                               chunks=10, server_wait_s=0.00125),
    "gpu-libero-32-s7": Regime("gpu-libero-32-s7", 32, 16, 0.12, 0.007, 0.00005, net_s=0.002, reset_s=0.075,
                               chunks=10, server_wait_s=0.00125),
    # session 31's H100 LIBERO rows at 16 envs (libero_10 tasks 0-3, 160 steps, wam-ref small behind wamkit serve):
    # a chunk 367-420 ms with every env busy (the tasks at 1.0 / 0.97 / 0.71 / 0.75 of the dearest), server compute
    # ~21 ms flat at batches 1-2, ~4.5 ms of transport each way, soft resets ~0.3 s; 96 episodes (rows of 31-36 s,
    # too short for a probe round). Real time scale
    "gpu-libero-16-s31": Regime("gpu-libero-16-s31", 16, 16, 0.45, 0.021, 0.0002, net_s=0.0045, jitter=0.1,
                                reset_s=0.3, chunks=10, episodes=96, server_wait_s=0.002,
                                task_cost=(1.0, 0.97, 0.71, 0.75)),
    # the H200 MetaWorld table of session 8 (16 envs on 16 cores, wam-ref small behind `wamkit serve`, max_wait 2 ms):
    # a chunk 16 steps ~39 ms (simulation alone 6589 env steps/s), server compute ~21-23 ms nearly flat in batch size,
    # the client seeing ~11 ms more per request than compute + wait (transport, encode/decode); 192 episodes of 100
    # steps (~6 chunks); jitter 0.05: the lockstep rows ran near the per-env loop bound. Real time scale (not / 4)
    "gpu-metaworld-16-s8": Regime("gpu-metaworld-16-s8", 16, 16, 0.039, 0.021, 0.0001, net_s=0.0056,
                                  jitter=0.05, episodes=192, server_wait_s=0.002),
    # the H200 MetaWorld table of session 9 (16 envs, 400-step episodes, websocket transport, idle dispatch): a chunk
    # ~20-24 ms, server compute ~23 ms flat in batch size beside the simulators (contended), ~6 ms more per request
    # as the client sees it; the four tasks simulate at different speeds (the CPU here: 83 / 104 / 114 / 94 ms a
    # chunk for reach / push / pick-place / drawer-open). Real time scale
    "gpu-metaworld-16-s9": Regime("gpu-metaworld-16-s9", 16, 16, 0.021, 0.023, 0.00005, net_s=0.003, chunks=25,
                                  episodes=192, server_wait_s=0.0, task_cost=(0.85, 1.05, 1.15, 0.95)),
    # the H200 MetaWorld table of session 10 (16 envs, 6 tasks, 500-step episodes, websocket, idle dispatch): a chunk
    # 22.0 ms with every env busy, server compute ~22-24 ms flat in batch size; a lockstep request of 16 observations
    # 30.8 ms of which 22.1 server compute: ~1.5 ms + 0.18 ms per observation of transport each way. Real time scale
    "gpu-metaworld-16-s10": Regime("gpu-metaworld-16-s10", 16, 16, 0.022, 0.0225, 0.0001, net_s=0.0015,
                                   net_b=0.00018, jitter=0.1, chunks=31, episodes=192, server_wait_s=0.0,
                                   task_cost=(0.85, 1.05, 1.15, 0.95, 1.0, 0.9)),
    # session 13's H100 MetaWorld table (16 envs, 6 tasks, 500-step episodes): the loop bound's chunk 26.9 ms, server
    # compute 21.8-24.3 ms at every request size, transport as in s10. The machine ranked B=8, P=2 (4333) > B=16,
    # P=1 (4318) > B=1, P=16 (4107). Real time scale
    "gpu-metaworld-16-s13": Regime("gpu-metaworld-16-s13", 16, 16, 0.0269, 0.022, 0.0001, net_s=0.0015,
                                   net_b=0.00018, jitter=0.1, chunks=31, episodes=288, server_wait_s=0.0,
                                   task_cost=(0.85, 1.05, 1.15, 0.95, 1.0, 0.9)),
    # session 16's H100 MetaWorld rows at 32 envs (10 tasks, 500 episodes of 500 steps): a chunk ~16 ms, server
    # compute 19 ms for 16 observations beside the simulators, ~3 ms transport each way; chunks vary a lot (a cohort
    # of 16 waited ~10 ms for its slowest env). Real time scale. bench_planner.py --transients runs it with a slowdown
    "gpu-metaworld-32-s16": Regime("gpu-metaworld-32-s16", 32, 16, 0.016, 0.013, 0.0004, net_s=0.003, jitter=0.3,
                                   chunks=31, episodes=500, server_wait_s=0.0,
                                   task_cost=(0.85, 1.05, 1.15, 0.95, 1.0, 0.9, 1.1, 0.8, 1.2, 1.0)),
    # session 19's H100 rows at 32 envs (10 tasks x 40 episodes of 500 steps; the B=16, P=2 timelines): chunks 16.0
    # ms on average, each task's own mean (deciles of the episodes' means / their mean, below) with ~4 ms of noise
    # within an episode; server compute 21.7-22.5 ms at batches 12-16 (flat); ~3.4 ms from a request's send to its
    # compute and ~1.7 ms from the compute's end to the reply (2.5 ms each way here). Real time scale
    "gpu-metaworld-32-s19": Regime("gpu-metaworld-32-s19", 32, 16, 0.016, 0.0215, 0.00005, net_s=0.0025, jitter=0.4,
                                   chunks=31, episodes=400, server_wait_s=0.0,
                                   task_cost=(0.64, 0.69, 0.73, 0.78, 0.85, 0.93, 1.01, 1.1, 1.5, 1.72)),
    # session 26's H100 rows at 16 envs (8 tasks x 50 episodes of 500 steps): the server's batch ~13.5 ms at any size
    # beside the renderers, ~1.5 ms transport each way; the tasks' paces from session 16's 16-env timelines (the
    # B=8, P=2 row of device_2026-12-05d/call2: per env a median chunk of 9.5 ms on four tasks, 13.1 on two, 20.3 on
    # two; +-30% within a task), a scene load ~0.3 s. Real time scale. Measured: B=1, P=16 the best row (6452.9
    # against B=8, P=2's 6194.5); the model: 6841 against 6382 (bench/bench_pace.py)
    "gpu-metaworld-16-s26": Regime("gpu-metaworld-16-s26", 16, 16, 0.0131, 0.0135, 0.00005, net_s=0.0015,
                                   jitter=0.3, chunks=31, episodes=400, server_wait_s=0.0, load_s=0.3,
                                   task_cost=(0.725, 0.725, 0.725, 0.725, 1.0, 1.0, 1.55, 1.55)),
    "gpu-metaworld-shared-16": Regime("gpu-metaworld-shared-16", 16, 16, 0.040, 0.0125, 0.0004, share_gain=0.5),
    # simulation-heavy: calls are cheap
    "sim-bound-8": Regime("sim-bound-8", 8, 8, 0.060, 0.004, 0.0002, episodes=48),
}


def with_(r: Regime, **kw) -> Regime:
    return dataclasses.replace(r, **kw)


def with_server_wait(r: Regime, wait_s: float | None) -> Regime:
    """The regime with (wait_s seconds) or without (None) the server's own batching; a batching server runs one batch
    at a time, so overlapping calls no longer share the accelerator."""
    return with_(r, server_wait_s=wait_s, share_gain=0.0 if wait_s is not None else r.share_gain)
