"""The evaluation scheduler: M env workers, one work queue of episodes, three ways to feed them actions.

- serial:    one env, one observation per request, one request at a time (the single-batch baseline when it also
             renders every step and runs episodes to max steps).
- pipelines: the reference design (RLinf's Cosmos3 + SGLang LIBERO evaluation; docs/evaluation.md). Envs split
             into P groups; each group loops "simulate all its envs -> send its
             observations in requests of B, one after another, each awaited -> act", so one group simulates while
             another waits for inference.
- auto:      asynchronous flow. Each env that finishes its chunk joins the next request batch without waiting for a
             group; several requests in flight; the batch size and in-flight depth are chosen from measured
             simulation and inference times (see RequestPlanner.plan). Where the server merges concurrent requests,
             that plan is measured against sending whatever waits at once and against lockstep, and the fastest
             kept (eval/shape_probe.py).

Common to all: each env takes its next episode as soon as its current one ends (one of the same task while any is
queued, so the scene stays loaded; envs spread over the tasks and switch scenes only where it pays: eval/affinity.py);
every planned episode runs
exactly once (a crashed env worker is restarted and its episode re-run from its init state; so is a stalled one, see
CallDeadlines); the policy's noise seed is a function of (episode, env step) only, so per-episode results do not
depend on the schedule."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from wamkit.core.errors import RunError
from wamkit.core.types import ChunkResult, Observation
from wamkit.eval.affinity import TaskAffinity
from wamkit.eval.inference import Inference
from wamkit.eval.plan import Episode, step_seed
from wamkit.eval.shape_probe import GREEDY, HALVES, LOCKSTEP, PLAN, SHAPES, ShapeProbe
from wamkit.eval.timeline import Timeline

log = logging.getLogger(__name__)


class EpisodeFailed(RunError):
    """An episode crashed (or stalled) its env worker on every attempt: the run stops, naming it."""


@dataclass
class EpisodeOutcome:
    episode: Episode
    success: bool
    steps: int
    env_steps: int        # steps executed (with run_to_max_steps this can exceed `steps`)
    wall_s: float
    env_index: int
    attempts: int
    frames: list[np.ndarray] = field(default_factory=list)
    actions_digest: str = ""  # hash of every action chunk the episode executed: equal digests, equal trajectories
    chunks: int = 0           # action chunks executed (its last attempt)
    sim_s: float = 0.0        # seconds they took, as the evaluating process saw them (per task: its pace)


def chunk_digest() -> "hashlib._Hash":
    """Running digest of an episode's executed chunks (float32 bytes), for schedule-invariance checks."""
    return hashlib.blake2b(digest_size=8)


@dataclass
class SchedulerOptions:
    mode: str = "serial"
    request_size: int = 1
    pipelines: int = 1
    depth: int = 0
    max_request_size: int = 0
    probe: bool = True          # auto: measure the model's plan against other shapes (eval/shape_probe.py)
    shapes: tuple[str, ...] = SHAPES   # ... those it measures (one: that shape, unprobed)
    group_by_task: bool = False
    run_to_max_steps: bool = False
    render_every_step: bool = False
    video_episodes: frozenset[int] = frozenset()
    seed: int = 0
    max_episode_retries: int = 3
    cores: int = 2
    env_timeout_min_s: float = 60.0      # see CallDeadlines
    env_timeout_factor: float = 10.0
    env_timeout_first_s: float = 600.0


class CallDeadlines:
    """How long an env worker may take to answer one call before it counts as stalled (killed, restarted, its
    episode re-run, as after a crash).

    The deadline of a call is max(min_s, factor x the slowest call of its kind measured so far), kinds being reset,
    execute and execute with per-step rendering. A worker's first call of each kind after it was (re)started, and
    any call of a kind not measured yet, gets first_s instead: the first reset or chunk may load assets or compile
    shaders; those calls are not measured either."""

    def __init__(self, min_s: float, factor: float, first_s: float):
        self.min_s, self.factor, self.first_s = float(min_s), float(factor), float(first_s)
        self.slowest: dict[str, float] = {}

    def limit(self, kind: str, first: bool) -> float:
        seen = self.slowest.get(kind)
        if first or seen is None:
            return max(self.first_s, self.min_s)
        return max(self.min_s, self.factor * seen)

    def observe(self, kind: str, seconds: float) -> None:
        self.slowest[kind] = max(self.slowest.get(kind, 0.0), float(seconds))


def _crash_types():
    try:
        from wamkit.envs.worker import EnvWorkerCrashed

        return (EnvWorkerCrashed,)
    except ImportError:  # pragma: no cover
        return ()


def _timeout_error(index: int, msg: str) -> Exception:
    from wamkit.envs.worker import EnvWorkerTimeout   # a crash type: the recovery paths handle it as a crash

    return EnvWorkerTimeout(index, msg)


@dataclass
class ChunkCosts:
    """What each chunk cost in its env's own process, where the env reports it (ChunkResult.worker_*): the wall
    time, of it the process's CPU time, and its camera rendering."""
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    render_s: list[float] = field(default_factory=list)

    def add(self, res: ChunkResult) -> None:
        for seconds, v in ((self.wall_s, res.worker_s), (self.cpu_s, res.worker_cpu_s),
                           (self.render_s, res.worker_render_s)):
            if v is not None:
                seconds.append(v)

    def summary(self) -> dict[str, float | None]:
        """The summary's means in ms (None without reports): sim_worker_ms_mean, cpu_ and render_worker_ms_mean."""
        def mean_ms(xs: list[float]) -> float | None:
            return 1000.0 * statistics.fmean(xs) if xs else None

        return {"sim_worker_ms_mean": mean_ms(self.wall_s), "cpu_worker_ms_mean": mean_ms(self.cpu_s),
                "render_worker_ms_mean": mean_ms(self.render_s)}


class Scheduler:
    """Runs `episodes` on `envs` (objects with async reset/execute, restart(), index) with `inference`.

    on_done(outcome) is called once per finished episode, in completion order (the journal appends there)."""

    def __init__(self, envs: list[Any], inference: Inference, episodes: list[Episode], opts: SchedulerOptions,
                 on_done: Callable[[EpisodeOutcome], None], timeline: Timeline | None = None):
        self.envs, self.inference, self.opts, self.on_done = envs, inference, opts, on_done
        self.queue: deque[Episode] = deque(episodes)
        self.timeline = timeline
        self.crash_types = _crash_types()
        self.restarts = 0
        self.env_timeouts = 0     # calls that missed their deadline (the worker was killed and restarted)
        self.deadlines = CallDeadlines(opts.env_timeout_min_s, opts.env_timeout_factor, opts.env_timeout_first_s)
        self._warm: set[tuple[int, str]] = set()   # (env, call kind) answered at least once since the env started
        self.simulating = 0
        self.active_envs = 0
        self.sim_samples: deque[tuple[float, int]] = deque(maxlen=200)   # (seconds, concurrent sims)
        self.chunk_costs = ChunkCosts()
        self.sim_started: dict[int, float] = {}   # env index -> monotonic start of the chunk it is simulating
        self.reset_started: dict[int, float] = {}  # env index -> monotonic start of the reset under way
        self.reset_samples: deque[float] = deque(maxlen=50)   # seconds of the resets done
        self.batcher: RequestPlanner | None = None
        self.episode_walls: deque[float] = deque(maxlen=100)   # wall seconds of the episodes done (latest)
        self.started = time.monotonic()     # reset when run() starts
        # env -> task bookkeeping; workers kept from an earlier run report the scene they have loaded and how long
        # their last scene load took
        loads = [s for e in envs if isinstance(s := getattr(e, "load_s", None), float)]
        self.affinity = TaskAffinity({i: t for i, e in enumerate(envs)
                                      if isinstance(t := getattr(e, "loaded_task", None), int)},
                                     statistics.median(loads) if loads else None)

    # ---- env-side primitives (with timeline spans) -------------------------------------------------------------
    async def _call(self, i: int, kind: str, coro):
        """Await one env call under its deadline; past it, kill the worker and raise EnvWorkerTimeout (a crash)."""
        first = (i, kind) not in self._warm
        limit = self.deadlines.limit(kind, first)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(limit) as cm:
                out = await coro
        except TimeoutError:
            if not cm.expired():
                raise
            self.env_timeouts += 1
            log.warning("env worker %d did not answer %s within %.1f s (stalled); killing it", i, kind, limit)
            kill = getattr(self.envs[i], "kill", None)
            if kill is not None:
                try:
                    kill()
                except Exception:  # noqa: BLE001 - restart() tears it down in any case
                    log.exception("killing env worker %d failed", i)
            raise _timeout_error(i, f"no answer to {kind} within {limit:.1f} s") from None
        if not first:
            self.deadlines.observe(kind, time.monotonic() - t0)
        self._warm.add((i, kind))
        return out

    async def _reset(self, i: int, ep: Episode) -> Observation:
        t0 = time.time()
        self.simulating += 1
        self.reset_started[i] = m0 = time.monotonic()
        if self.affinity.reset_begun(i, ep.task_id) and self.batcher is not None:
            # a scene load: what waits for this env may go without it (joinable_soon)
            asyncio.get_running_loop().call_soon(self.batcher.poke)
        try:
            obs = await self._call(i, "reset", self.envs[i].reset(ep.task_id, ep.trial))
            dt = time.monotonic() - m0
            self.reset_samples.append(dt)
            self.affinity.reset_done(i, ep.task_id, dt)
            return obs
        finally:
            self.simulating -= 1
            self.reset_started.pop(i, None)
            if self.timeline is not None:
                self.timeline.add(f"env/{i}", "reset", t0, time.time())

    async def _execute(self, i: int, ep: Episode, chunk: np.ndarray) -> ChunkResult:
        t0 = time.time()
        self.simulating += 1
        conc = self.simulating
        self.sim_started[i] = time.monotonic()
        render = self.opts.render_every_step or ep.index in self.opts.video_episodes
        try:
            res = await self._call(i, "execute+render" if render else "execute", self.envs[i].execute(
                chunk, render_every_step=render, run_to_max_steps=self.opts.run_to_max_steps))
            self.chunk_costs.add(res)
            return res
        finally:
            self.simulating -= 1
            self.sim_started.pop(i, None)
            t1 = time.time()
            self.sim_samples.append((t1 - t0, conc))
            if self.timeline is not None:
                self.timeline.add(f"env/{i}", "sim", t0, t1)

    async def _restart_env(self, i: int) -> None:
        self.restarts += 1
        log.warning("env worker %d crashed or stalled; restarting it and re-running its episode", i)
        self._warm = {w for w in self._warm if w[0] != i}
        await asyncio.to_thread(self.envs[i].restart)
        self.affinity.forget(i)   # a fresh process: no scene loaded (its episode is re-run where it is)

    def _next_episode(self, i: int) -> Episode | None:
        """Env i's next episode, or None when it has none worth loading a scene for (eval/affinity.py)."""
        return self.affinity.next_episode(i, self.queue)

    def _done(self, out: EpisodeOutcome) -> None:
        self.episode_walls.append(out.wall_s)
        self.affinity.episode_done(out.env_index)
        self.on_done(out)

    # ---- one episode, actions from `get_actions` ----------------------------------------------------------------
    async def _run_episode(self, i: int, ep: Episode, get_actions) -> EpisodeOutcome:
        attempts = 0
        restart = False
        while True:
            attempts += 1
            t0 = time.time()
            frames: list[np.ndarray] = []
            try:
                if restart:     # inside the try: a restart that fails (or stalls) is one more failed attempt
                    await self._restart_env(i)
                obs = await self._reset(i, ep)
                if ep.index in self.opts.video_episodes:
                    frames.append(next(iter(obs.images.values())))
                env_steps = chunks = 0
                sim_s = 0.0
                digest = chunk_digest()
                while True:
                    # seed from the env step at which the observation was taken: schedule-independent
                    seed = step_seed(self.opts.seed, ep, env_steps)
                    chunk = await get_actions(i, ep, obs, seed)
                    digest.update(np.ascontiguousarray(chunk, np.float32).tobytes())
                    m0 = time.monotonic()
                    res = await self._execute(i, ep, chunk)
                    chunks, sim_s = chunks + 1, sim_s + time.monotonic() - m0
                    env_steps += res.steps
                    if ep.index in self.opts.video_episodes:   # the baseline renders every step: keep no frames
                        frames.extend(res.frames)
                    if res.done:
                        return EpisodeOutcome(ep, bool(res.success), int(res.episode_steps), env_steps,
                                              time.time() - t0, i, attempts, frames, digest.hexdigest(), chunks,
                                              sim_s)
                    obs = res.obs
            except self.crash_types:
                if attempts > self.opts.max_episode_retries:
                    raise EpisodeFailed(f"episode {ep.key} crashed its env worker {attempts} times") from None
                restart = True

    async def _env_loop(self, i: int, get_actions) -> None:
        self.active_envs += 1
        try:
            while (ep := self._next_episode(i)) is not None:
                self._done(await self._run_episode(i, ep, get_actions))
        finally:
            self.active_envs -= 1
            if self.batcher is not None:
                self.batcher.poke()

    # ---- modes --------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        mode = self.opts.mode
        self.started = time.monotonic()
        if mode != "serial":
            self.affinity.start(self.queue, len(self.envs))
        if mode == "serial":
            await self._env_loop(0, self._direct_actions)
        elif mode == "auto":
            self.batcher = RequestPlanner(self)
            await asyncio.gather(*(self._env_loop(i, self.batcher.submit) for i in range(len(self.envs))))
        elif mode == "pipelines":
            p = self.opts.pipelines
            groups = [list(range(len(self.envs)))[g::p] for g in range(p)]
            await asyncio.gather(*(self._group_loop(g) for g in groups if g))
        else:
            raise ValueError(f"unknown mode {mode!r}")

    async def _direct_actions(self, i: int, ep: Episode, obs: Observation, seed: int) -> np.ndarray:
        return (await self.inference.predict([obs], [seed]))[0]

    async def _group_loop(self, env_ids: list[int]) -> None:
        """Reference pipeline stage: lockstep over the group's envs; requests of B sent one after another."""
        b = max(1, self.opts.request_size)

        async def start(i: int):
            # a reset that crashes (or stalls) the worker is an attempt, as in _run_episode (uncounted, a poisoned
            # init state was retried forever while the group's other envs waited for it)
            if (ep := self._next_episode(i)) is None:
                return None
            for attempts in itertools.count(1):
                try:
                    if attempts > 1:
                        await self._restart_env(i)
                    return {"ep": ep, "obs": await self._reset(i, ep), "steps": 0, "t0": time.time(),
                            "frames": [], "attempts": attempts, "digest": chunk_digest(), "chunks": 0, "sim_s": 0.0}
                except self.crash_types:
                    if attempts > self.opts.max_episode_retries:
                        raise EpisodeFailed(f"episode {ep.key} crashed its env worker {attempts} times") from None

        state: dict[int, dict | None] = dict(zip(env_ids, await asyncio.gather(*(start(i) for i in env_ids))))

        async def step(i: int, chunk: np.ndarray):
            st = state[i]
            ep = st["ep"]
            st["digest"].update(np.ascontiguousarray(chunk, np.float32).tobytes())
            m0 = time.monotonic()
            try:
                res = await self._execute(i, ep, chunk)
            except self.crash_types:
                while True:
                    st["attempts"] += 1
                    if st["attempts"] > self.opts.max_episode_retries + 1:
                        raise EpisodeFailed(f"episode {ep.key} crashed its env worker {st['attempts'] - 1} times")
                    try:
                        await self._restart_env(i)
                        st.update(obs=await self._reset(i, ep), steps=0, t0=time.time(), frames=[],
                                  digest=chunk_digest(), chunks=0, sim_s=0.0)
                        return
                    except self.crash_types:
                        continue
            st["steps"] += res.steps
            st["chunks"] += 1
            st["sim_s"] += time.monotonic() - m0
            if ep.index in self.opts.video_episodes:
                st["frames"].extend(res.frames)
            if res.done:
                self._done(EpisodeOutcome(ep, bool(res.success), int(res.episode_steps), st["steps"],
                                            time.time() - st["t0"], i, st["attempts"], st["frames"],
                                            st["digest"].hexdigest(), st["chunks"], st["sim_s"]))
                state[i] = await start(i)
            else:
                st["obs"] = res.obs
                st["episode_steps"] = res.episode_steps

        while True:
            active = [i for i in env_ids if state[i] is not None]
            if not active:
                return
            chunks: dict[int, np.ndarray] = {}
            for k in range(0, len(active), b):
                ids = active[k:k + b]
                obs = [state[i]["obs"] for i in ids]
                seeds = [step_seed(self.opts.seed, state[i]["ep"], state[i]["steps"]) for i in ids]
                out = await self.inference.predict(obs, seeds)   # blocking within the group, as the reference
                chunks.update(zip(ids, out))
            await asyncio.gather(*(step(i, chunks[i]) for i in active))


def joinable_soon(p: "RequestPlanner") -> int:
    """The planner's joinable envs, less those loading a scene predicted to end more than a call from now: the
    lockstep and halves shapes send without them, and they join a later request. A load takes ~0.3 s on MetaWorld
    (~15 calls) and seconds on LIBERO: in session 21's 32-env H100 rows auto's lockstep waited out each of the row's
    scene loads with every other env idle, 1.9 s of its 26.2 s, about what it lost to the B=16, P=2 row. A load
    past its predicted end is not waited for either: when it ends is no longer known (LIBERO's vary 5-10 s)."""
    loads = p.s.affinity.loads_under_way()
    if not loads:
        return p._joinable()
    now = time.monotonic()
    soon = now + p._median_call(50, default=0.0)
    return p._joinable() - sum(1 for end in loads.values() if not now <= end <= soon)


def send_by_shape(p: "RequestPlanner") -> None:
    """Dispatch what the planner's current shape, one of the measured shapes other than the plan, sends now (the
    shapes: RequestPlanner.shape)."""
    if p.shape == GREEDY:   # one request per observation, as the B = 1, P = envs row (see RequestPlanner.shape)
        while p.pending and p.in_flight < max(1, p.s.active_envs):
            p._dispatch(1)
    elif p.shape == LOCKSTEP:
        while p.pending and joinable_soon(p) <= 0:
            p._dispatch(p.cap)
    elif p.shape == HALVES:
        active = max(1, p.s.active_envs)
        half = min(p.cap, math.ceil(active / 2))
        depth = math.ceil(active / half)
        while p.pending and p.in_flight < depth and (len(p.pending) >= half or joinable_soon(p) <= 0):
            p._dispatch(half)


# Where the server merges requests and an env's chunk lasts over GREEDY_CHUNK_CALLS x a call, auto sends every
# observation at once (greedy) until its probe measures the shapes (start_shape). There the cost model's plan, which
# counts in-flight requests as calls one after another, holds observations to batch them and keeps fewer requests
# out: on the H100 in session 31 (LIBERO, chunks 12-13x a call at 16 envs, 6-8x at 32) the plan ran at 0.950 and
# 0.938 of the greedy row (its envs waited 10 and 36 ms a cycle outside the request), and rows of 24-36 s were too
# short for a probe round (4 shapes x 10 cycles of 0.4-0.7 s) to pay back. MetaWorld's chunks are 1-3x a call.
GREEDY_CHUNK_CALLS = 5.0
KEPT_DECISIONS = 4096   # RequestPlanner.decisions: the most recent requests kept


def recent_calls(inf: Inference, last: int) -> list[tuple[int, float]]:
    """The last `last` (batch size, seconds) of inf.latencies (a bounded deque, or a list)."""
    lat = inf.latencies
    return list(itertools.islice(lat, max(0, len(lat) - last), None))


def start_shape(p: "RequestPlanner") -> None:
    """Before the probe's first round, once a chunk and a call have been measured (once): greedy instead of the plan
    where an env's chunk lasts over GREEDY_CHUNK_CALLS calls. The probe, when a round can pay back, then measures
    greedy first and every other shape after it, as it would have the plan."""
    probe = p.probe
    if (probe is None or p.began_with is not None or probe.rounds or probe.probing or probe.current != PLAN
            or GREEDY not in probe.shapes or not p.s.sim_samples or not p.inf.latencies):
        return
    chunk = p._sim_cost() * max(1.0, p.s.active_envs / max(1, p.s.opts.cores))
    call = p._median_call(50, default=0.0)
    if chunk > GREEDY_CHUNK_CALLS * call:
        probe.current = GREEDY
    p.began_with = {"shape": probe.current, "chunk_ms": round(chunk * 1e3, 2), "call_ms": round(call * 1e3, 2)}


class RequestPlanner:
    """Collects observations from envs as they finish their chunks and sends them in batches.

    Plan: with A active envs, a single-env simulation cost s0 per chunk on C cores, and inference latency
    I(n) = a + b n (fitted online from measured calls), split the envs into k cohorts of n = ceil(A/k) and pick k
    minimizing the cycle time
        cycle(k) = max(k * I(n),                     # the inference side serves k batches per cycle
                       S(n) + I(n),                  # one env's own loop: simulate, then wait for its batch
                       A * s0 / C)                   # the CPU side simulates every env once per cycle
    with S(n) = s0 * max(1, n / C). The target batch is n; up to k requests are in flight (depth). A batch is sent
    when n observations wait, or when no simulating env could still join it, or when waiting stops paying: the next
    env to finish its chunk is predicted (its start + the current per-chunk simulation time) and waited for only if
    it comes within straggler_wait(a, m) (a: the fixed cost of one inference call, which a later lone observation
    would pay again; m: observations waiting), and never longer than that after the batch could have gone."""

    TIE = 0.05   # cycle times within 5% of the best count as equal
    # Near-ties go to fewer, larger batches (the cycle model ignores that concurrent requests queue behind each
    # other) unless a chunk costs over CHEAP_CALL x a call (the median measured call): then batching saves
    # accelerator time nobody waits for, while gathering a batch makes envs wait, so near-ties go to more, smaller
    # requests in flight (bench/planner_sim.py figures in docs/benchmarks.md 2b).
    CHEAP_CALL = 5.0
    # How long m waiting observations wait for one more env (and never longer): a x min(MAX, SHARE / (m + 1)). Waiting
    # d costs each of the m waiting envs d and saves the late env a call of its own (a, the fixed cost of one call),
    # so the budget shrinks as m grows. Measured over bench/planner_sim.py's regimes: min auto / best fixed row 0.92
    # (a flat 0.35 / 0.5 / 0.65 / 1.0 x a: 0.74 / 0.92 / 0.89 / 0.75), and the CPU Cosmos3 case (a chunk ~0.51 x a
    # after soft resets: auto alternated single requests under the flat 0.5) batches its two envs.
    STRAGGLER_MAX, STRAGGLER_SHARE = 0.6, 2.0
    ARRIVAL_MARGIN = 0.2   # x the chunk time: how late past its prediction an awaited env may come

    @classmethod
    def straggler_wait(cls, a: float, waiting: int) -> float:
        return a * min(cls.STRAGGLER_MAX, cls.STRAGGLER_SHARE / (max(1, waiting) + 1))

    def __init__(self, sched: Scheduler):
        self.s = sched
        self.inf = sched.inference
        self.pending: list[tuple[Observation, int, Episode, asyncio.Future, float]] = []  # (.., arrival time)
        self.in_flight = 0
        self.obs_in_flight = 0      # observations of the requests in flight (their envs cannot join a batch)
        self._slot_free_at = 0.0    # when a request slot last came free (waiting for a slot is not waiting to batch)
        self.cap = sched.opts.max_request_size or self.inf.max_request_size
        self.cap = max(1, min(self.cap, self.inf.max_request_size))
        self.fixed_depth = sched.opts.depth
        self._timer: asyncio.TimerHandle | None = None
        self.decisions: deque[tuple[int, int]] = deque(maxlen=KEPT_DECISIONS)   # (observations, in flight), latest
        # a fixed depth is the user's plan: nothing to measure it against
        # (and sending at once only pays where the server merges what arrives together)
        merges = bool(getattr(self.inf, "merges_requests", False))
        self.probe = (ShapeProbe(tuple(sched.opts.shapes)) if merges and self.fixed_depth == 0 and sched.opts.probe
                      else None)
        self.began_with: dict | None = None   # start_shape's decision and the figures it read (None: not yet)

    @property
    def shape(self) -> str:
        """plan: the cost model's (batch, depth) and straggler rule; greedy: every observation goes at once, as a
        request of its own (the B = 1, P = envs row's pattern), as many in flight as there are envs (a batching
        server merges them; until session 22 greedy packed whoever waited into one request, and where auto kept it
        at 32 envs on H100s it ran 3-6% below that row, for a cause not established); lockstep: one request of
        every env's observation once no env could still join (B = envs, P = 1); halves: requests of half the
        active envs (at most the cap), at most two out at once (more where half exceeds the cap), each sent once
        half the envs wait (whichever envs they are) or no env could still join (B = envs / 2, P = 2 without fixed
        cohorts: one half simulates while the other's call runs)."""
        return self.probe.current if self.probe is not None else PLAN

    # -- measurements -> plan
    def _fit_inference(self) -> tuple[float, float]:
        lat = recent_calls(self.inf, 100)
        if not lat:
            return 0.05, 0.0
        ns = np.array([n for n, _ in lat], float)
        ts = np.array([t for _, t in lat], float)
        if len(set(ns.tolist())) >= 2:
            b, a = np.polyfit(ns, ts, 1)
            a, b = max(float(a), 0.0), max(float(b), 0.0)
            return a, b
        return float(np.median(ts)), 0.0

    def _sim_cost(self) -> float:
        if not self.s.sim_samples:
            return 0.1
        c = self.s.opts.cores
        per = [t * min(conc, c) / conc for t, conc in self.s.sim_samples]
        return float(statistics.median(per))

    def plan(self) -> tuple[int, int]:
        """(target batch n, depth k) for the current number of active envs."""
        a_envs = max(1, self.s.active_envs)
        if self.fixed_depth > 0:
            k = min(self.fixed_depth, a_envs)
            return min(self.cap, math.ceil(a_envs / k)), k
        a, b = self._fit_inference()
        s0 = self._sim_cost()
        c = max(1, self.s.opts.cores)
        options = []
        for k in range(1, a_envs + 1):
            n = math.ceil(a_envs / k)
            if n > self.cap:
                continue
            inf = a + b * n
            options.append((max(k * inf, s0 * max(1.0, n / c) + inf, a_envs * s0 / c), n, k))
        if not options:
            return self.cap, math.ceil(a_envs / self.cap)
        best = min(c for c, _, _ in options)
        ties = [o for o in options if o[0] <= best * (1 + self.TIE)]
        call = self._median_call(100, default=a + b)
        cheap = bool(self.s.sim_samples) and s0 > self.CHEAP_CALL * call   # measured chunks only (see CHEAP_CALL)
        _, n, k = (max if cheap else min)(ties, key=lambda o: o[2])
        return n, k

    # -- flow
    async def submit(self, i: int, ep: Episode, obs: Observation, seed: int) -> np.ndarray:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((obs, seed, ep, fut, time.monotonic()))
        # decide once every env whose chunk ended at this instant has submitted (the loop's next turn): poking here
        # sent the first of sixteen envs that start together alone, and that 1 + 15 split persisted (docs 2b)
        asyncio.get_running_loop().call_soon(self.poke)
        return await fut

    def _joinable(self) -> int:
        """Envs that could still join the waiting batch: active, not waiting, not in a request in flight (they are
        simulating, resetting, or just got their actions and are about to simulate)."""
        return self.s.active_envs - len(self.pending) - self.obs_in_flight

    def shape_summary(self) -> dict:
        """What auto measured and kept (summary.scheduler.auto_shape)."""
        if self.probe is None:
            why = "depth fixed" if self.fixed_depth else ("probe off" if not self.s.opts.probe
                                                          else "requests are not merged (one model call each)")
            return {"shape": PLAN, "probed": False, "why": why, "rounds": []}
        return {"shape": self.probe.current, "probed": bool(self.probe.rounds), "rounds": self.probe.summary(),
                **({"began_with": self.began_with} if self.began_with else {})}   # start_shape's choice

    def _median_call(self, last: int, default: float) -> float:   # the last `last` calls' (default before any)
        lat = recent_calls(self.inf, last)
        return statistics.median(t for _, t in lat) if lat else default

    def _cycle_s(self) -> float:
        """One env's cycle now: its chunk (at the current concurrency) plus a call."""
        c = max(1, self.s.opts.cores)
        return self._sim_cost() * max(1.0, self.s.active_envs / c) + self._median_call(50, default=0.0)

    def _remaining_s(self) -> float | None:
        """The run's rest: episodes queued or under way x the mean episode's wall time / active envs. Before any
        episode has ended, a lower bound: every queued episode will take longer than the run so far has lasted, and
        they run `active` at a time (so a long run is measured early, a short one never)."""
        walls, active = self.s.episode_walls, self.s.active_envs
        if active <= 0:
            return None
        if not walls:
            return len(self.s.queue) / active * (time.monotonic() - self.s.started)
        return (len(self.s.queue) + active) * statistics.fmean(walls) / active

    def poke(self) -> None:
        start_shape(self)
        if self.shape != PLAN:
            send_by_shape(self)
            return
        n, k = self.plan()
        while self.pending and self.in_flight < k:
            if len(self.pending) >= n or self._joinable() <= 0 or self._timed_out():
                self._dispatch(n)
            else:
                self._arm_timer()
                break

    def _timed_out(self) -> bool:
        return bool(self.pending) and time.monotonic() >= self._deadline()

    def _deadline(self) -> float:
        """When the waiting observations should go (monotonic time)."""
        now = time.monotonic()
        a, _ = self._fit_inference()
        joinable = self._joinable()
        wait = self.straggler_wait(a, len(self.pending))
        # the wait counts from when the batch could have gone (a slot came free), not from when it began to wait:
        # an observation that waited out another request's call has not yet waited to be batched
        ready = max(self.pending[0][4], self._slot_free_at)
        started = list(self.s.sim_started.values())
        c = max(1, self.s.opts.cores)
        chunk = self._sim_cost() * max(1.0, len(started) / c)
        arrivals = [t + chunk for t in started]
        if joinable > self.s.simulating:          # envs that got their actions and are about to simulate
            arrivals.append(now + chunk)
        if self.s.reset_started and self.s.reset_samples:   # resets end about as long as the last ones took
            reset = statistics.median(self.s.reset_samples)   # (a scene load: as long as the loads done took)
            loads = self.s.affinity.loads_under_way()
            arrivals += [loads.get(i, t + reset) for i, t in self.s.reset_started.items()]
            if not self.inf.latencies:
                # the first request: nothing measured about calls yet, and the envs' first resets started together
                wait = max(wait, reset)
        if not arrivals:   # nothing predictable under way
            return ready + max(0.002, min(wait, 0.5 * self._sim_cost()))
        soonest = max(0.0, min(arrivals) - now)
        if soonest > wait:
            return now    # the next env comes later than waiting is worth: send now
        # the predicted arrival plus a margin for a chunk that runs long and for the result's way back
        return min(now + soonest + self.ARRIVAL_MARGIN * chunk + 0.005, ready + max(wait, 0.002))

    def _arm_timer(self) -> None:
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.001, self._deadline() - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self.shape != PLAN:
            self.poke()
            return
        if self.pending and self.in_flight < self.plan()[1]:
            self._dispatch(self.plan()[0])
            self.poke()

    def _dispatch(self, n: int) -> None:
        n = max(1, min(n, self.cap))
        take = self.pending[:n]
        if self.s.opts.group_by_task:
            # the observations of one task side by side; the client sends one HTTP request per prompt group, all at
            # once, so several tasks still go out together (taking only the first task's observations serialized
            # the tasks behind each other whenever the envs ran different tasks)
            first = {}
            for p in take:
                first.setdefault(p[2].task_id, len(first))
            take.sort(key=lambda p: first[p[2].task_id])
        ids = {id(p[3]) for p in take}
        self.pending = [p for p in self.pending if id(p[3]) not in ids]
        self.in_flight += 1
        self.obs_in_flight += len(take)
        self.decisions.append((len(take), self.in_flight))
        asyncio.get_running_loop().create_task(self._send(take))

    async def _send(self, take) -> None:
        try:
            out = await self.inf.predict([p[0] for p in take], [p[1] for p in take])
            for p, a in zip(take, out):
                if not p[3].done():
                    p[3].set_result(a)
        except Exception as e:  # noqa: BLE001 - surfaces in the env loops that wait on these futures
            for p in take:
                if not p[3].done():
                    p[3].set_exception(e)
        finally:
            self.in_flight -= 1
            self.obs_in_flight -= len(take)
            self._slot_free_at = now = time.monotonic()
            if self.probe is not None:
                # the probe's clock: seconds since the run started (its rounds' at_s read as such in the summary)
                # (the estimates as functions: computed only when the probe needs them, not per answer)
                self.probe.answered(now - self.s.started, len(take), self._cycle_s, self.s.active_envs,
                                    self._remaining_s)
            self.poke()
