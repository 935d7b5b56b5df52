"""How busy the evaluating process is: the event loop that runs every env's calls and every request.

One asyncio loop feeds all envs (scheduler.py): it sends each env its chunk, reads its observation back, packs the
requests and unpacks the replies. Where it is busy or late, every env waits on it, and that wait shows in the
timeline only as "outside the request" (eval/bench.py cycle_lines). LoopHealth measures it directly, for the
summary (`scheduler.client`):

- loop_cpu: CPU seconds of the loop's thread per wall second (1.0: the loop alone keeps one core busy);
- process_cpu: the same for the whole process (the loop plus its decode and I/O threads), in cores;
- loop_lag_ms: how late a timer of PERIOD_S fired (p50, p99, max): the time a ready callback waits for the loop.

The lags go into a histogram of fixed size (LagHistogram: bins 2% wide), not a list: the timer fires 200 times a
second, so an evaluation of hours would otherwise keep millions of samples. Percentiles come within 2%; the maximum
and the count are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import numpy as np

PERIOD_S = 0.005   # the lag probe's timer


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


class LoopHealth:
    """start() and stop() inside the running loop (its thread's CPU time is read there); summary() after stop()."""

    def __init__(self, period_s: float = PERIOD_S):
        self.period_s = float(period_s)
        self.lags = LagHistogram()
        self._task: asyncio.Task | None = None
        self._t0 = self._thread0 = self._proc0 = 0.0
        self._wall = self._thread = self._proc = 0.0

    def start(self) -> None:
        self._t0, self._thread0, self._proc0 = time.perf_counter(), time.thread_time(), time.process_time()
        self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lags.add(max(0.0, time.perf_counter() - t - self.period_s))

    async def stop(self) -> None:
        self._wall = time.perf_counter() - self._t0
        self._thread = time.thread_time() - self._thread0
        self._proc = time.process_time() - self._proc0
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def summary(self) -> dict | None:
        """None before a stop() with time measured."""
        if self._wall <= 0:
            return None
        h = self.lags
        return {"loop_cpu": round(self._thread / self._wall, 3), "process_cpu": round(self._proc / self._wall, 3),
                "loop_lag_ms": {"p50": round(1000.0 * h.percentile(50), 3), "p99": round(1000.0 * h.percentile(99), 3),
                                "max": round(1000.0 * h.max, 3), "n": h.n}}
