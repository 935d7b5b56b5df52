"""How busy the evaluating process is: the event loop that runs every env's calls and every request.

One asyncio loop feeds all envs (scheduler.py): it sends each env its chunk, reads its observation back, packs the
requests and unpacks the replies. Where it is busy or late, every env waits on it, and that wait shows in the
timeline only as "outside the request" (eval/bench.py cycle_lines). LoopHealth measures it directly, for the
summary (`scheduler.client`):

- loop_cpu: CPU seconds of the loop's thread per wall second (1.0: the loop alone keeps one core busy);
- process_cpu: the same for the whole process (the loop plus its decode and I/O threads), in cores;
- loop_lag_ms: how late a timer of PERIOD_S fired (p50, p99, max): the time a ready callback waits for the loop.

- stalls: the longest times the loop did not run at all (at least STALL_S), each with when it began (seconds after
  start()) and where the loop's thread was then: a watchdog thread looks at that thread's stack once the probe is
  STALL_S late (`sys._current_frames`). On the GPU machine in session 21 the loop's timers were 90-305 ms late at worst
  in 12 of 18 rows, and nothing in the timeline said why; this says where.
- gc_max_ms: the longest garbage collection of the run on the loop's thread (a full one over a large heap holds the
  loop too).

What it found on the GPU machine (session 22): in 7 of 12 rows of 32 envs the loop's longest stall, 90-247 ms, was
a full garbage collection (`gc_max_ms` the same figure; `where` in a weakref callback or this module's gc hook),
one or two a row, while every env waited. The heap was what setup had built (torch, the envs' handles) and a
full collection walks all of it, so the run now freezes that heap first (core/heap.py, `EvalConfig.gc_freeze`):
collections during the run look only at what the run itself allocates.

The lags go into a histogram of fixed size (LagHistogram: bins 2% wide), not a list: the timer fires 200 times a
second, so an evaluation of hours would otherwise keep millions of samples. Percentiles come within 2%; the maximum
and the count are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import math
import sys
import threading
import time
import traceback

import numpy as np

PERIOD_S = 0.005   # the lag probe's timer
STALL_S = 0.05     # the loop this late: the watchdog records where its thread is
WATCH_S = 0.01     # how often the watchdog looks
KEEP = 5           # stalls kept (the longest)
FRAMES = 6         # innermost frames kept per stall


class LagHistogram:
    """Seconds in log-spaced bins: [0, FLOOR_S) in bin 0, then bins RATIO wide up to CEIL_S (above: the last bin).
    Percentiles within RATIO of the samples' (a bin's geometric middle, clipped to the exact maximum)."""

    FLOOR_S = 1e-6
    CEIL_S = 1e3
    RATIO = 1.02

    def __init__(self):
        self._log_ratio = math.log(self.RATIO)
        self.counts = np.zeros(2 + int(math.log(self.CEIL_S / self.FLOOR_S) / self._log_ratio), np.int64)
        self.n = 0
        self.max = 0.0

    def add(self, x: float) -> None:
        i = 0 if x < self.FLOOR_S else 1 + int(math.log(x / self.FLOOR_S) / self._log_ratio)
        self.counts[min(i, len(self.counts) - 1)] += 1
        self.n += 1
        self.max = max(self.max, x)

    def percentile(self, q: float) -> float:
        """The q-th percentile (0-100); 0.0 without samples."""
        if self.n == 0:
            return 0.0
        i = int(np.searchsorted(np.cumsum(self.counts), q / 100.0 * self.n))
        if i == 0:
            return 0.0
        if i >= len(self.counts) - 1:   # the overflow bin: its samples are only bounded by the maximum
            return self.max
        return min(self.max, self.FLOOR_S * self.RATIO ** (i - 0.5))


def _where(frame) -> list[str]:
    """The innermost FRAMES frames of a stack, innermost first, as "file.py:line function" (no source lines read:
    the watchdog holds the interpreter lock while it looks)."""
    frames = traceback.StackSummary.extract(traceback.walk_stack(frame), limit=FRAMES, lookup_lines=False)
    return [f"{fs.filename.rsplit('/', 1)[-1]}:{fs.lineno} {fs.name}" for fs in frames]


class LoopHealth:
    """start() and stop() inside the running loop (its thread's CPU time is read there); summary() after stop()."""

    def __init__(self, period_s: float = PERIOD_S, stall_s: float = STALL_S):
        self.period_s, self.stall_s = float(period_s), float(stall_s)
        self.lags = LagHistogram()
        self.stalls: list[tuple[float, float, list[str]]] = []   # a min-heap of (seconds, began at, where)
        self.gc_max_s = 0.0
        self._task: asyncio.Task | None = None
        self._t0 = self._thread0 = self._proc0 = 0.0
        self._wall = self._thread = self._proc = 0.0
        self._beat = 0.0                                   # when the probe last ran (perf_counter)
        self._seen: tuple[float, list[str]] | None = None  # the watchdog's look at the stall under way
        self._loop_thread = 0
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._gc_t0 = 0.0

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._stop.clear()
        self._beat = time.perf_counter()
        self._watchdog = threading.Thread(target=self._watch, name="loop-health-watchdog", daemon=True)
        self._watchdog.start()           # (waits for the thread to run: the measured span starts after it)
        gc.callbacks.append(self._on_gc)
        self._t0, self._thread0, self._proc0 = time.perf_counter(), time.thread_time(), time.process_time()
        self._beat = self._t0
        self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            t = self._beat = time.perf_counter()
            await asyncio.sleep(self.period_s)
            late = max(0.0, time.perf_counter() - t - self.period_s)
            self.lags.add(late)
            seen, self._seen = self._seen, None
            if late >= self.stall_s:
                where = seen[1] if seen is not None and seen[0] == t else []
                item = (late, t - self._t0, where)
                if len(self.stalls) < KEEP:
                    heapq.heappush(self.stalls, item)
                elif item[0] > self.stalls[0][0]:
                    heapq.heapreplace(self.stalls, item)

    def _watch(self) -> None:
        """The watchdog thread: once the probe is stall_s late, where the loop's thread is (once per stall)."""
        while not self._stop.wait(WATCH_S):
            beat = self._beat
            if time.perf_counter() - beat - self.period_s < self.stall_s:
                continue
            if self._seen is not None and self._seen[0] == beat:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is not None:
                self._seen = (beat, _where(frame))

    def _on_gc(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self._loop_thread:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0:
            self.gc_max_s = max(self.gc_max_s, time.perf_counter() - self._gc_t0)
            self._gc_t0 = 0.0

    async def stop(self) -> None:
        self._wall = time.perf_counter() - self._t0
        self._thread = time.thread_time() - self._thread0
        self._proc = time.process_time() - self._proc0
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join()
            self._watchdog = None
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def summary(self) -> dict | None:
        """None before a stop() with time measured."""
        if self._wall <= 0:
            return None
        h = self.lags
        return {"loop_cpu": round(self._thread / self._wall, 3), "process_cpu": round(self._proc / self._wall, 3),
                "loop_lag_ms": {"p50": round(1000.0 * h.percentile(50), 3), "p99": round(1000.0 * h.percentile(99), 3),
                                "max": round(1000.0 * h.max, 3), "n": h.n},
                "stalls": [{"ms": round(1000.0 * d, 1), "at_s": round(at, 3), "where": where}
                           for d, at, where in sorted(self.stalls, reverse=True)],
                "gc_max_ms": round(1000.0 * self.gc_max_s, 1)}
