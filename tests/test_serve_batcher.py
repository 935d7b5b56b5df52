"""The server's DynamicBatcher on its own (no HTTP): the fill window counts from the end of the previous batch, so
observations that queued during a batch wait for the clients that batch just answered instead of leaving alone.
A predict that blocks on an event controls when a batch ends; arrival times are set explicitly (no sleeps, no timing
thresholds)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from wamkit.core.errors import ConfigError
from wamkit.core.types import Observation
from wamkit.serve.batcher import DynamicBatcher
from wamkit.serve.config import ServeConfig


class GatedPredict:
    """predict that records each batch's seeds and blocks until released (one release per batch)."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)

    def __call__(self, obs, seeds):
        self.batches.append([int(s) for s in seeds])
        self.started.release()
        self.release.acquire()
        return np.asarray(seeds, np.float32)[:, None, None] * np.ones((1, 2, 3), np.float32)


OBS = Observation({"image": np.zeros((4, 4, 3), np.uint8)}, None, "t")


async def _submit(b: DynamicBatcher, seeds: list[int]):
    return await b.submit([OBS] * len(seeds), seeds, ["k"] * len(seeds))


async def _wait_started(p: GatedPredict) -> None:
    while not p.started.acquire(blocking=False):
        await asyncio.sleep(0.001)


def test_queued_during_a_batch_waits_for_the_next_arrivals():
    """Batch A (full) computes; B (2 obs) queues meanwhile and is made to look long overdue (arrived 10 min ago, the
    window is 60 s). When A ends, B still waits: its window starts at A's end. C (2 obs, A's clients coming back)
    joins it: one full batch B+C, not B alone then C alone."""
    async def main():
        p = GatedPredict()
        b = DynamicBatcher(p, max_batch_size=4, max_wait_ms=60000, max_queue=64)
        await b.start()
        ta = asyncio.create_task(_submit(b, [1, 2, 3, 4]))
        await _wait_started(p)
        tb = asyncio.create_task(_submit(b, [5, 6]))
        while b.queued < 2:
            await asyncio.sleep(0.001)
        for dq in b._groups.values():               # B has "waited" far longer than max_wait_ms
            for it in dq:
                it.t -= 600.0
        p.release.release()                          # A ends
        a, _ = await ta
        assert a[:, 0, 0].tolist() == [1, 2, 3, 4]
        assert len(p.batches) == 1 and not tb.done()  # B did not leave alone
        tc = asyncio.create_task(_submit(b, [7, 8]))
        await _wait_started(p)
        p.release.release()
        (bb, tim_b), (cc, _) = await tb, await tc
        await b.close()
        return p.batches, bb, cc, tim_b

    batches, bb, cc, tim_b = asyncio.run(main())
    assert batches == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert bb[:, 0, 0].tolist() == [5, 6] and cc[:, 0, 0].tolist() == [7, 8]
    assert tim_b["batch_size"] == 4


def test_a_lone_partial_batch_leaves_after_its_window():
    """Nobody else comes: a partial batch still runs (window 1 ms), and closing flushes what is queued."""
    async def main():
        p = GatedPredict()
        b = DynamicBatcher(p, max_batch_size=8, max_wait_ms=1, max_queue=64)
        await b.start()
        t = asyncio.create_task(_submit(b, [3]))
        await _wait_started(p)
        p.release.release()
        out, timing = await t
        t2 = asyncio.create_task(_submit(b, [4, 5]))
        await _wait_started(p)
        p.release.release()
        await t2
        await b.close()
        return p.batches, out, timing

    batches, out, timing = asyncio.run(main())
    assert batches == [[3], [4, 5]] and out.shape == (1, 2, 3) and timing["batch_size"] == 1


def test_fill_window_follows_the_batch_time():
    b = DynamicBatcher(lambda o, s: None, max_batch_size=4, max_wait_ms=5, max_queue=8, max_wait_fraction=0.1)
    assert b.fill_window_s() == pytest.approx(0.005)
    b._ema_batch_s = 1.5                              # a 1.5 s GPU batch: wait up to 150 ms for it to fill
    assert b.fill_window_s() == pytest.approx(0.15)
    b.max_wait_fraction = 0.0
    assert b.fill_window_s() == pytest.approx(0.005)


@pytest.mark.parametrize("key,value", [("max_wait_fraction", 1.5), ("max_wait_fraction", -0.1),
                                       ("decode_threads", 0)])
def test_new_keys_are_checked(key, value):
    with pytest.raises(ConfigError, match=key):
        ServeConfig(**{key: value}).validate()
