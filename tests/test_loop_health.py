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


def test_a_stall_is_kept_with_when_it_began_and_where_the_loop_was():
    """A function that holds the loop for 150 ms (sleeping: the watchdog thread can run) is named as the stall's
    innermost frame, its length at least the block's and its start after the run's first 50 ms; a 10 ms block is no
    stall; a garbage collection on the loop's thread is timed; stop() ends the watchdog and the gc hook."""
    import gc

    h = LoopHealth(period_s=0.002, stall_s=0.05)

    def blocking_step():
        time.sleep(0.15)

    async def main() -> None:
        h.start()
        await asyncio.sleep(0.06)
        time.sleep(0.01)                   # short: not a stall
        await asyncio.sleep(0.02)
        blocking_step()
        await asyncio.sleep(0.02)
        gc.collect()
        await asyncio.sleep(0.01)
        await h.stop()

    asyncio.run(main())
    s = h.summary()
    # (a full collection in a process this size can be a stall of its own: kept too, named by the gc hook's frame)
    mine = [x for x in s["stalls"] if x["where"] and "blocking_step" in x["where"][0]]   # the innermost frame
    assert len(mine) == 1 and all(x["ms"] >= 50.0 for x in s["stalls"]), s["stalls"]
    assert mine[0]["ms"] >= 150.0 - 2.0 and 0.05 <= mine[0]["at_s"] <= 0.3
    assert not [x for x in s["stalls"] if x["where"] and x["where"][0].endswith(" main")]   # the 10 ms block: none
    assert s["gc_max_ms"] > 0.0
    assert h._watchdog is None and h._on_gc not in gc.callbacks
