"""eval/loop_health.py: the evaluating process's loop, measured (CPU of its thread and of the process, timer lag)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from wamkit.eval.loop_health import LagHistogram, LoopHealth


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
    assert s["loop_lag_ms"]["n"] == h.lags.n >= 3
    assert s["loop_cpu"] >= 0.15 / wall - 0.001
    assert s["process_cpu"] >= s["loop_cpu"] - 0.001   # the process's CPU includes the loop thread's
    assert h._task is None                             # the probe is stopped, not left running


def test_no_summary_before_stop():
    assert LoopHealth().summary() is None


def test_the_lag_histogram_keeps_percentiles_within_its_bins_in_fixed_memory():
    """Lags spread over four decades: the histogram's p50 / p99 within 2% of the samples' own, the maximum and the
    count exact, its size the same after 100 000 samples as before the first; zeros stay zero."""
    rng = np.random.default_rng(0)
    x = np.exp(rng.uniform(np.log(1e-5), np.log(0.2), 100_000))
    h = LagHistogram()
    size = h.counts.nbytes
    for v in x:
        h.add(float(v))
    for q in (50, 99):
        assert abs(h.percentile(q) / np.percentile(x, q) - 1) <= 0.02, q
    assert h.max == x.max() and h.n == len(x) and h.counts.nbytes == size
    z = LagHistogram()
    for _ in range(10):
        z.add(0.0)
    assert z.percentile(50) == 0.0 and z.percentile(99) == 0.0 and LagHistogram().percentile(50) == 0.0
    big = LagHistogram()
    big.add(5e3)      # above the last bin's edge: counted there, the maximum exact
    assert big.max == 5e3 and big.percentile(50) == 5e3
