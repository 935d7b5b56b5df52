"""Dynamic batcher: observations from concurrent requests -> batches for policy.predict, off the event loop.

- Every observation carries a group key (parameters except seed, camera names and image shapes, state length);
  a batch only ever holds observations of one key.
- A group is dispatched when it holds max_batch_size observations, when its oldest observation has waited max_wait_ms,
  or at once when the batcher is closing. Among ready groups the one with the oldest observation goes first (FIFO).
- Refill (max_wait_fraction > 0; 0, the default, turns it off): while clients the server answered are still coming
  back (more observations answered than arrived since; the count is kept across batches, so a small batch of
  stragglers does not end the wait for the others), a partial group waits for them up to max_wait_fraction x the
  longest of the last 8 batch compute times, counted from the end of the previous batch. If that window passes,
  the missing ones are given up on (the count restarts at 0), the rule above applies, and refill pauses for the next
  8 batches (clients slower than the window: waiting only idles the device; a probe every 8 batches costs at most
  1/8 of a window per batch). Closed-loop clients (a
  fleet of robots, benchmark loops: one observation each, the next one sent as soon as the chunk is back) otherwise
  settle into two partial batches per round, each paying the policy's fixed cost: the observations that queued during
  a batch leave as soon as it ends, without the ones it just answered (64 clients at max_batch_size 64: mean batch
  ~32 instead of 64). Refill pays when the clients come back within about the policy's fixed cost; when they take
  longer (they step a simulator first, as the pipelined evaluation's other pipeline does, or encode PNGs on a busy
  CPU) the alternating halves hide their turnaround better and the device would idle for the window: off by
  default.
- Idle dispatch (idle_dispatch=True; off by default): when no batch is computing and no other request is being
  received or decoded by the server (its intake: headers in, not yet submitted; intake_begin / intake_end), a group
  leaves at once instead of waiting max_wait_ms for company nobody has announced: the continuous-batching rule, which
  spares a lone or lockstep client (one request in flight at a time) max_wait_ms per request. While other requests
  are in intake, the group waits for them as before (until full, or max_wait_ms); a refill window still applies.
  Observations that arrive while a batch computes queue for the next batch either way.
- One batch computes at a time (predict in one worker thread) while the next one forms: the event loop keeps
  accepting and decoding requests, so observations that arrive during a batch queue for the next one. The refill
  window starts once the finished batch's requests have had their turn on the event loop (responses written).
- Lanes (several predict callables: the server's concurrent_batches, one policy replica each): up to that many
  batches compute at once, one per lane and worker thread; a group that is ready leaves as soon as a lane is free,
  so an observation arriving while one batch computes need not wait for it (a GPU that one small batch leaves
  mostly idle runs two side by side). Refill is meant for one lane (it counts from the last batch to end).
- The queue is bounded (max_queue observations): submit raises QueueFull (the server answers 503 + Retry-After).
- What predict returns is checked (wamkit.policies.checks.check_chunks, the rule in-process evaluation applies too):
  (N, H, action_dim) with action_dim and the horizon of the policy's spec (a longer chunk cut to the horizon, a
  shorter one refused), a float dtype (converted to float32), finite values. Anything else fails the batch with a
  PolicyOutputError naming the policy and what was wrong (the server answers 500 and keeps serving). The spec is the
  one of the object each predict callable is bound to (`policy.predict`), or given (check_output=<spec>); False: no
  check but (N, H, D) (a caller that checks itself).
- Metrics count what predict ran: a failed batch and each of its requests run again alone are all batches (with
  their observations); a request's timing is that of the batch that answered it (batch_size: its size).
- close() stops accepting, runs everything already queued, then stops the worker thread; abort() (an interrupted
  in-process evaluation) stops at once, without waiting for a batch that computes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from wamkit.core.types import Observation
from wamkit.policies.base import PolicySpec
from wamkit.policies.checks import check_chunks


Predict = Callable[[Sequence[Observation], Sequence[int]], np.ndarray]
REFILL_PAUSE_BATCHES = 8   # after a refill window passed without the clients coming back, batches without refill


class QueueFull(Exception):
    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDown(QueueFull):
    pass


@dataclass
class _Request:
    n: int
    t_arrival: float                      # time.time()
    future: asyncio.Future
    actions: np.ndarray | None = None
    remaining: int = 0
    t_start: float | None = None
    t_end: float | None = None
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Item:
    obs: Observation
    seed: int
    req: _Request
    index: int
    t: float                              # time.perf_counter() at arrival


class DynamicBatcher:
    def __init__(self, predict: Predict | Sequence[Predict], max_batch_size: int,
                 max_wait_ms: float, max_queue: int, metrics: Any = None, max_wait_fraction: float = 0.0,
                 idle_dispatch: bool = False, check_output: PolicySpec | bool = True, executor: Any = None):
        """predict: one callable, or one per lane (module doc), each (observations, seeds) -> (N, H, D) actions.
        check_output: True (default) checks each answer against the spec of the policy its lane's callable is bound
        to, a PolicySpec against that one, False only its shape (N, H, D). executor: where predict runs (default: a
        thread per lane, owned and shut down here)."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.lanes: list[Predict] = list(predict) if isinstance(predict, (list, tuple)) else [predict]
        if not self.lanes:
            raise ValueError("the batcher needs at least one predict callable")
        self._specs: list[PolicySpec | None] = [_spec_of(p, check_output) for p in self.lanes]
        self._executor = executor
        self._free_lanes = list(range(len(self.lanes)))
        self._running: set[asyncio.Task] = set()
        self.max_batch_size = int(max_batch_size)
        self.max_wait_s = max(0.0, float(max_wait_ms)) / 1000.0
        self.max_wait_fraction = max(0.0, float(max_wait_fraction))
        self.max_queue = int(max_queue)
        self.idle_dispatch = bool(idle_dispatch)
        self.metrics = metrics
        self._intake = 0                         # requests being received/decoded, not yet submitted
        self._groups: collections.OrderedDict[Hashable, collections.deque[_Item]] = collections.OrderedDict()
        self._queued = 0
        self._closing = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._free_since = time.perf_counter()   # when the previous batch finished (the device became free)
        self._out = 0                            # observations answered and not (yet) followed by a new one
        self._refill_paused = 0                  # batches left before refill is tried again after a give-up
        self._ema_batch_s = 0.0
        self._recent_batch_s: collections.deque[float] = collections.deque(maxlen=8)  # compute times, newest last

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._pool = self._executor or ThreadPoolExecutor(max_workers=len(self.lanes),
                                                          thread_name_prefix="wamkit-predict")
        self._task = asyncio.create_task(self._loop(), name="wamkit-batcher")

    def begin_close(self) -> None:
        """Stop accepting and dispatch everything queued now, without waiting for batches to fill (event loop thread;
        from elsewhere use loop.call_soon_threadsafe)."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()

    async def close(self) -> None:
        """Stop accepting; run what is queued; stop the worker thread."""
        self.begin_close()
        if self._task is not None:
            await self._task
        if self._pool is not None and self._executor is None:
            self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Stop now (event loop thread): queued requests fail with ShuttingDown, the loop and the batches in flight
        are cancelled, and a predict still running is not waited for (its thread finishes on its own)."""
        self._closing = True
        for t in [self._task, *self._running]:
            if t is not None and not t.done():
                t.cancel()
        for dq in self._groups.values():
            for it in dq:
                if not it.req.future.done():
                    it.req.future.set_exception(ShuttingDown("stopped"))
        self._groups.clear()
        self._queued = 0
        if self._pool is not None and self._executor is None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def intake_begin(self) -> None:
        """A request is being received/decoded (event loop thread); pair with intake_end before its submit."""
        self._intake += 1

    def intake_end(self) -> None:
        """That request was submitted, refused or dropped: an idle-dispatch group waiting for it may leave."""
        self._intake = max(0, self._intake - 1)
        if self.idle_dispatch and self._intake == 0 and self._wake is not None:
            self._wake.set()

    @contextlib.contextmanager
    def intake(self):
        """A route's receive/decode/check of one request (intake_begin ... intake_end, also when it is refused);
        nothing may await between the block's end and the request's submit."""
        self.intake_begin()
        try:
            yield
        finally:
            self.intake_end()

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def closing(self) -> bool:
        return self._closing

    # ------------------------------------------------------------------ submit
    async def submit(self, observations: Sequence[Observation], seeds: Sequence[int],
                     keys: Sequence[Hashable]) -> tuple[np.ndarray, dict[str, Any]]:
        """Queue N observations; wait for their (N, H, D) actions and the request's timing."""
        n = len(observations)
        if self._closing:
            raise ShuttingDown("server is shutting down", retry_after_s=1.0)
        if self._queued + n > self.max_queue:
            raise QueueFull(f"queue full ({self._queued} of {self.max_queue} observations waiting)",
                            retry_after_s=self.retry_after_s())
        loop = asyncio.get_running_loop()
        req = _Request(n=n, t_arrival=time.time(), future=loop.create_future(), remaining=n)
        now = time.perf_counter()
        for i in range(n):
            dq = self._groups.get(keys[i])
            if dq is None:
                dq = self._groups[keys[i]] = collections.deque()
            dq.append(_Item(observations[i], int(seeds[i]), req, i, now))
        self._queued += n
        self._out = max(0, self._out - n)
        self._wake.set()
        actions = await req.future
        timing = {"queue_ms": round((req.t_start - req.t_arrival) * 1000.0, 3),
                  "compute_ms": round((req.t_end - req.t_start) * 1000.0, 3),
                  "batch_size": max(req.batch_sizes), "batches": len(req.batch_sizes),
                  "t_start": req.t_start, "t_end": req.t_end}
        if self.metrics is not None:
            self.metrics.queued(timing["queue_ms"])
        return actions, timing

    def retry_after_s(self) -> float:   # when a refused request may find room (at least 1 s)
        batches_ahead = self._queued / self.max_batch_size + 1
        return max(1.0, round(batches_ahead * max(self._ema_batch_s, 0.01), 1))

    def refill_window_s(self) -> float:
        """How long a partial group waits, from the end of the previous batch, for the clients it answered (0: it does
        not; module doc)."""
        if self.max_wait_fraction <= 0 or self._out <= 0 or self._refill_paused > 0:
            return 0.0
        return self.max_wait_fraction * max(self._recent_batch_s, default=0.0)

    # ------------------------------------------------------------------ loop
    def _pick(self) -> tuple[Hashable | None, float]:
        """(ready group key or None, seconds until the earliest group deadline)."""
        now = time.perf_counter()
        best, best_t, first_deadline = None, None, None
        refill = self.refill_window_s()
        if refill and now >= self._free_since + refill:   # the missing ones are not coming: give up on them
            self._out, refill, self._refill_paused = 0, 0.0, REFILL_PAUSE_BATCHES
        wait_s = 0.0 if self.idle_dispatch and self._intake == 0 else self.max_wait_s
        for key, dq in self._groups.items():
            t = dq[0].t
            deadline = max(t + wait_s, self._free_since + refill)
            first_deadline = deadline if first_deadline is None else min(first_deadline, deadline)
            if self._closing or len(dq) >= self.max_batch_size or now >= deadline:
                if best_t is None or t < best_t:
                    best, best_t = key, t
        wait = 0.0 if first_deadline is None else max(0.0, first_deadline - now)
        return best, wait

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._groups or not self._free_lanes:   # nothing queued, or every lane computing
                if self._closing and not self._groups:
                    if self._running:
                        await asyncio.gather(*self._running)
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            key, wait = self._pick()
            if key is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=max(wait, 1e-4))
                except (asyncio.TimeoutError, TimeoutError):
                    pass
                continue
            dq = self._groups[key]
            batch = [dq.popleft() for _ in range(min(len(dq), self.max_batch_size))]
            if not dq:
                del self._groups[key]
            self._queued -= len(batch)
            lane = self._free_lanes.pop(0)
            if len(self.lanes) == 1:   # one batch at a time: the next one forms while this one computes
                await self._run(loop, batch, lane)
                continue
            task = asyncio.create_task(self._run(loop, batch, lane))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _compute(self, loop: asyncio.AbstractEventLoop, items: list[_Item],
                       lane: int) -> tuple[np.ndarray | None, BaseException | None]:
        """The policy on `items` in one call: (actions, None), or (None, the error) if it failed."""
        try:
            out = await loop.run_in_executor(self._pool, self.lanes[lane], [it.obs for it in items],
                                             [it.seed for it in items])
            spec = self._specs[lane]
            if spec is None:
                out = np.asarray(out, dtype=np.float32)
                if out.ndim != 3 or out.shape[0] != len(items):
                    raise RuntimeError(f"policy returned shape {list(out.shape)} for a batch of {len(items)}")
                return out, None
            return check_chunks(out, len(items), action_dim=spec.action.dim, horizon=spec.action.horizon,
                                who=f"policy {spec.name!r}"), None
        except Exception as e:  # the requests in this batch fail; the server keeps serving
            return None, e

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Item], lane: int = 0) -> None:
        t0 = time.time()
        p0 = time.perf_counter()
        out, err = await self._compute(loop, batch, lane)
        dt = time.perf_counter() - p0
        t1 = t0 + dt
        self._ema_batch_s = dt if self._ema_batch_s == 0 else 0.8 * self._ema_batch_s + 0.2 * dt
        self._recent_batch_s.append(dt)
        if self.metrics is not None:
            self.metrics.batch(len(batch), dt * 1000.0)
        if err is not None and len({id(it.req) for it in batch}) > 1:
            await self._each_request_alone(loop, batch, lane)
        else:
            _deliver(batch, out, err, t0, t1)
        self._free_lanes.append(lane)
        self._wake.set()                     # a lane is free (the loop waits for one when all compute)
        await asyncio.sleep(0)               # the answered requests write their responses first ...
        self._free_since = time.perf_counter()   # ... then the next batch's clock starts
        self._out += len(batch)
        self._refill_paused = max(0, self._refill_paused - 1)


    async def _each_request_alone(self, loop: asyncio.AbstractEventLoop, batch: list[_Item], lane: int) -> None:
        """A batch merged from several requests failed: each request's rows run again on their own, so the error
        reaches only the request that causes it (one client's input that makes the policy raise must not fail every
        request it shared a batch with). A fault that is not one request's (the policy process died) fails each
        request in its own call; seeds are per observation, so a request's actions do not depend on its batch."""
        by_request: dict[int, list[_Item]] = {}
        for it in batch:
            by_request.setdefault(id(it.req), []).append(it)
        if self.metrics is not None:
            self.metrics.count("batches_split_after_error")
        for items in by_request.values():
            t0, p0 = time.time(), time.perf_counter()
            out, err = await self._compute(loop, items, lane)
            dt = time.perf_counter() - p0
            if self.metrics is not None:     # predict ran again: count it (observations_computed, batches)
                self.metrics.batch(len(items), dt * 1000.0)
            _deliver(items, out, err, t0, t0 + dt)


def _spec_of(predict: Predict, check: PolicySpec | bool) -> PolicySpec | None:
    """The spec a lane's answers are checked against (module doc): the given one, or that of the policy `predict` is
    a bound method of; None: shape (N, H, D) only."""
    if isinstance(check, PolicySpec):
        return check
    if not check:
        return None
    spec = getattr(getattr(predict, "__self__", None), "spec", None)
    return spec if isinstance(spec, PolicySpec) else None


def _deliver(batch: list[_Item], out: np.ndarray | None, err: BaseException | None, t0: float, t1: float) -> None:
    """A computed batch's rows (or its error) into their requests; a request is answered once all its rows are."""
    seen: set[int] = set()
    for j, it in enumerate(batch):
        r = it.req
        if id(r) not in seen:
            seen.add(id(r))
            r.batch_sizes.append(len(batch))
        if r.future.done():
            continue
        if err is not None:
            r.future.set_exception(err)
            continue
        if r.actions is None:
            r.actions = np.empty((r.n,) + out.shape[1:], np.float32)
        elif r.actions.shape[1:] != out.shape[1:]:
            r.future.set_exception(RuntimeError("policy returned differently shaped chunks for one request"))
            continue
        r.actions[it.index] = out[j]
        if r.t_start is None:
            r.t_start = t0
        r.t_end = t1
        r.remaining -= 1
        if r.remaining == 0:
            r.future.set_result(r.actions)
