"""eval/loop_health.py: the evaluating process's loop, measured (CPU of its thread and of the process, timer lag)."""

from __future__ import annotations

import asyncio
import time

from wamkit.eval.loop_health import LoopHealth


def test_a_blocked_loop_shows_as_lag_and_a_busy_one_as_cpu():
    """A callback that blocks the loop for 60 ms makes the probe's timer fire at least that late; a callback that
    spins until its thread has used 0.15 s of CPU shows as at least that much loop CPU over the wall time."""
    h = LoopHealth(period_s=0.002)

    async def main() -> float:
        h.start()
        t0 = time.perf_counter()
        await asyncio.sleep(0.02)          # the probe's timer is armed
        time.sleep(0.06)                   # the loop blocked: no timer can fire
        await asyncio.sleep(0.02)
        c0 = time.thread_time()
        while time.thread_time() - c0 < 0.15:   # the loop's thread busy
            pass
        await asyncio.sleep(0.02)
        await h.stop()
        return time.perf_counter() - t0

    wall = asyncio.run(main())
    s = h.summary()
    assert s["loop_lag_ms"]["max"] >= 60.0 - 2.0 - 0.5   # the block minus the timer's own period (and rounding)
    assert s["loop_lag_ms"]["n"] == len(h.lags) >= 3
    assert s["loop_cpu"] >= 0.15 / wall - 0.001
    assert s["process_cpu"] >= s["loop_cpu"] - 0.001   # the process's CPU includes the loop thread's
    assert h._task is None                             # the probe is stopped, not left running


def test_no_summary_before_stop():
    assert LoopHealth().summary() is None
