"""How busy the evaluating process is: the event loop that runs every env's calls and every request.

One asyncio loop feeds all envs (scheduler.py): it sends each env its chunk, reads its observation back, packs the
requests and unpacks the replies. Where it is busy or late, every env waits on it, and that wait shows in the
timeline only as "outside the request" (eval/bench.py cycle_lines). LoopHealth measures it directly, for the
summary (`scheduler.client`):

- loop_cpu: CPU seconds of the loop's thread per wall second (1.0: the loop alone keeps one core busy);
- process_cpu: the same for the whole process (the loop plus its decode and I/O threads), in cores;
- loop_lag_ms: how late a timer of PERIOD_S fired (p50, p99, max): the time a ready callback waits for the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

PERIOD_S = 0.005   # the lag probe's timer


class LoopHealth:
    """start() and stop() inside the running loop (its thread's CPU time is read there); summary() after stop()."""

    def __init__(self, period_s: float = PERIOD_S):
        self.period_s = float(period_s)
        self.lags: list[float] = []
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
            self.lags.append(max(0.0, time.perf_counter() - t - self.period_s))

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
        lag = np.asarray(self.lags or [0.0]) * 1000.0
        return {"loop_cpu": round(self._thread / self._wall, 3), "process_cpu": round(self._proc / self._wall, 3),
                "loop_lag_ms": {"p50": round(float(np.percentile(lag, 50)), 3),
                                "p99": round(float(np.percentile(lag, 99)), 3), "max": round(float(lag.max()), 3),
                                "n": len(self.lags)}}
