"""The server's DynamicBatcher on its own (no HTTP): after a batch, observations that queued during it wait for the
clients that batch just answered instead of leaving alone. A predict that blocks on a semaphore controls when a
batch ends; the windows are either 1 ms or enormous, so no assertion depends on timing."""

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


async def _a_running_b_queued(**kw):
    """A batcher (cap 4, max_wait_ms 1) computing batch A (obs 1-4) while group B (obs 5, 6) waits in its queue."""
    p = GatedPredict()
    b = DynamicBatcher(p, max_batch_size=4, max_wait_ms=1, max_queue=64, **kw)
    await b.start()
    ta = asyncio.create_task(_submit(b, [1, 2, 3, 4]))
    await _wait_started(p)
    tb = asyncio.create_task(_submit(b, [5, 6]))
    while b.queued < 2:
        await asyncio.sleep(0.001)
    return p, b, ta, tb


def test_queued_during_a_batch_waits_for_the_answered_clients():
    """Batch A (full, 4) computes; B (2 obs) queues meanwhile. When A ends, B does not leave after max_wait_ms (1 ms):
    A's 4 clients are expected back, so B's window is max_wait_fraction x the batch time (huge here). C (2 obs, two
    of A's clients coming back) joins it: one full batch B+C, not B alone then C alone. (With max_wait_fraction 0,
    the default, B would leave alone: the next test.)"""
    async def main():
        p, b, ta, tb = await _a_running_b_queued(max_wait_fraction=1e6)
        p.release.release()                          # A ends
        a, _ = await ta
        for _ in range(20):                           # give the batcher every chance to (wrongly) send B alone
            await asyncio.sleep(0.005)
        assert a[:, 0, 0].tolist() == [1, 2, 3, 4]
        assert len(p.batches) == 1 and not tb.done()
        tc = asyncio.create_task(_submit(b, [7, 8]))
        await _wait_started(p)
        p.release.release()
        (bb, tim_b), (cc, _) = await tb, await tc
        await b.close()
        return p.batches, bb, cc, tim_b

    batches, bb, cc, tim_b = asyncio.run(asyncio.wait_for(main(), 60))
    assert batches == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert bb[:, 0, 0].tolist() == [5, 6] and cc[:, 0, 0].tolist() == [7, 8]
    assert tim_b["batch_size"] == 4


def test_without_refill_the_queued_group_leaves_alone():
    """max_wait_fraction 0 (the default): B, queued during A for longer than max_wait_ms, runs as soon as A ends."""
    async def main():
        p, b, ta, tb = await _a_running_b_queued()
        await asyncio.sleep(0.01)                     # B is older than max_wait_ms
        p.release.release()
        await ta
        await _wait_started(p)                        # B runs alone
        p.release.release()
        await tb
        await b.close()
        return p.batches

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [[1, 2, 3, 4], [5, 6]]


def test_clients_that_came_back_wait_only_max_wait_ms():
    """A batch of 1 ends and its client comes back with 2 observations: nobody else is expected, so the partial batch
    leaves after max_wait_ms (1 ms), not after the long window (max_wait_fraction 1e6 x the batch time)."""
    async def main():
        p = GatedPredict()
        b = DynamicBatcher(p, max_batch_size=8, max_wait_ms=1, max_queue=64, max_wait_fraction=1e6)
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

    batches, out, timing = asyncio.run(asyncio.wait_for(main(), 60))
    assert batches == [[3], [4, 5]] and out.shape == (1, 2, 3) and timing["batch_size"] == 1


def test_closing_flushes_a_waiting_partial_batch():
    async def main():
        p = GatedPredict()
        b = DynamicBatcher(p, max_batch_size=8, max_wait_ms=600000, max_queue=64)
        await b.start()
        t = asyncio.create_task(_submit(b, [9, 10]))
        while b.queued < 2:
            await asyncio.sleep(0.001)
        p.release.release()                          # pre-release: the flushed batch runs straight through
        await b.close()
        return p.batches, await t

    batches, (out, _) = asyncio.run(asyncio.wait_for(main(), 60))
    assert batches == [[9, 10]] and out[:, 0, 0].tolist() == [9, 10]


def test_idle_dispatch_runs_a_lone_partial_batch_at_once():
    """idle_dispatch: an idle batcher with nothing in intake runs a partial group now, although max_wait_ms (10 min)
    says wait; without idle_dispatch the same group is still waiting when we look (it would wait the 10 min)."""
    async def main(idle: bool):
        p = GatedPredict()
        b = DynamicBatcher(p, max_batch_size=8, max_wait_ms=600000, max_queue=64, idle_dispatch=idle)
        await b.start()
        p.release.release()                          # the batch, once started, runs straight through
        t = asyncio.create_task(_submit(b, [1, 2]))
        for _ in range(100):
            if t.done():
                break
            await asyncio.sleep(0.005)
        done = t.done()
        await b.close()                              # flushes it if it was still waiting
        await t
        return done, p.batches

    assert asyncio.run(asyncio.wait_for(main(True), 60)) == (True, [[1, 2]])
    assert asyncio.run(asyncio.wait_for(main(False), 60)) == (False, [[1, 2]])


def test_idle_dispatch_waits_for_requests_in_intake_and_batches_them_together():
    """A request in intake (being received/decoded) holds an idle-dispatch group back: when it is submitted, both
    share one batch. Requests submitted together (one event-loop turn) share one batch too."""
    async def main():
        p = GatedPredict()
        b = DynamicBatcher(p, max_batch_size=8, max_wait_ms=600000, max_queue=64, idle_dispatch=True)
        await b.start()
        b.intake_begin()                             # request B's headers are in, its body is not
        ta = asyncio.create_task(_submit(b, [1, 2]))
        for _ in range(20):
            await asyncio.sleep(0.005)
        assert not p.batches and not ta.done()       # A waits for B
        b.intake_end()
        tb = asyncio.create_task(_submit(b, [3]))
        await _wait_started(p)
        p.release.release()
        await ta, await tb
        tc = asyncio.gather(_submit(b, [4]), _submit(b, [5, 6]), _submit(b, [7]))
        await _wait_started(p)
        p.release.release()
        await tc
        b.intake_begin()                             # a request refused in intake (bad body) releases the wait too
        td = asyncio.create_task(_submit(b, [8]))
        await asyncio.sleep(0.02)
        b.intake_end()
        await _wait_started(p)
        p.release.release()
        await td
        await b.close()
        return p.batches

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [[1, 2, 3], [4, 5, 6, 7], [8]]


def test_refill_window_follows_the_batch_time():
    b = DynamicBatcher(lambda o, s: None, max_batch_size=4, max_wait_ms=5, max_queue=8, max_wait_fraction=0.1)
    b._recent_batch_s.extend([0.3, 1.5, 0.4])         # the longest recent batch: 1.5 s
    b._out = 3                                        # 3 answered observations not back yet
    assert b.refill_window_s() == pytest.approx(0.15)  # wait up to 150 ms after the last batch
    b._out = 0
    assert b.refill_window_s() == 0.0                 # all back: max_wait_ms from the oldest arrival only
    b._out, b.max_wait_fraction = 3, 0.0
    assert b.refill_window_s() == 0.0                 # off (the default)


def test_refill_gives_up_and_pauses_when_clients_are_slower_than_the_window():
    from wamkit.serve.batcher import REFILL_PAUSE_BATCHES

    b = DynamicBatcher(lambda o, s: None, max_batch_size=64, max_wait_ms=5, max_queue=128, max_wait_fraction=0.25)
    b._recent_batch_s.append(1.0)
    b._out = 30                                       # 30 answered observations out ...
    b._free_since -= 10.0                             # ... for 10 s: far past the 250 ms window
    assert b.refill_window_s() == pytest.approx(0.25)
    b._pick()
    assert b._out == 0 and b._refill_paused == REFILL_PAUSE_BATCHES
    b._out = 30
    assert b.refill_window_s() == 0.0                 # paused: queued observations leave by max_wait_ms alone
    b._refill_paused = 0
    assert b.refill_window_s() == pytest.approx(0.25)


@pytest.mark.parametrize("key,value", [("max_wait_fraction", 1.5), ("max_wait_fraction", -0.1),
                                       ("decode_threads", 0)])
def test_new_keys_are_checked(key, value):
    with pytest.raises(ConfigError, match=key):
        ServeConfig(**{key: value}).validate()


def test_tune_malloc_applies_on_glibc_and_is_harmless_twice():
    import platform

    from wamkit.serve.http import tune_malloc

    expected = platform.libc_ver()[0] == "glibc"
    assert tune_malloc() is expected and tune_malloc() is expected
    big = [bytes(3 * 1024 * 1024) for _ in range(4)]   # allocations still work (heap, not mmap)
    assert sum(map(len, big)) == 12 * 1024 * 1024


def test_two_lanes_compute_two_batches_at_once_and_one_lane_does_not():
    """concurrent_batches: with two lanes, batch B starts on lane 2 while batch A still computes on lane 1 (A is held
    until B has started: with one lane that would deadlock, so the one-lane case only checks that B waits); every
    request gets its own rows back, and close() waits for both lanes."""
    async def two_lanes():
        p1, p2 = GatedPredict(), GatedPredict()
        b = DynamicBatcher([p1, p2], max_batch_size=4, max_wait_ms=1, max_queue=64)
        await b.start()
        ta = asyncio.create_task(_submit(b, [1, 2, 3, 4]))
        await _wait_started(p1)
        tb = asyncio.create_task(_submit(b, [5, 6]))
        await _wait_started(p2)                       # B runs on lane 2 while A has not ended
        p2.release.release()
        bb, _ = await tb
        assert not ta.done()
        p1.release.release()
        aa, _ = await ta
        await b.close()
        return p1.batches, p2.batches, aa, bb

    l1, l2, aa, bb = asyncio.run(asyncio.wait_for(two_lanes(), 60))
    assert l1 == [[1, 2, 3, 4]] and l2 == [[5, 6]]
    assert aa[:, 0, 0].tolist() == [1, 2, 3, 4] and bb[:, 0, 0].tolist() == [5, 6]

    async def one_lane():
        p, b, ta, tb = await _a_running_b_queued()
        for _ in range(20):                           # B stays queued while A computes
            await asyncio.sleep(0.005)
        assert len(p.batches) == 1 and b.queued == 2
        p.release.release()
        await _wait_started(p)
        p.release.release()
        await ta, await tb
        await b.close()
        return p.batches

    assert asyncio.run(asyncio.wait_for(one_lane(), 60)) == [[1, 2, 3, 4], [5, 6]]


def test_close_runs_the_queue_on_every_lane_and_waits_for_them():
    """close() while both lanes compute and more is queued: the queued group still runs (on the first free lane),
    every request is answered, and close() returns only after the last batch."""
    async def main():
        p1, p2 = GatedPredict(), GatedPredict()
        b = DynamicBatcher([p1, p2], max_batch_size=2, max_wait_ms=1, max_queue=64)
        await b.start()
        ts = [asyncio.create_task(_submit(b, [2 * i + 1, 2 * i + 2])) for i in range(3)]
        await _wait_started(p1)
        await _wait_started(p2)
        while b.queued < 2:
            await asyncio.sleep(0.001)
        closing = asyncio.create_task(b.close())
        await asyncio.sleep(0.01)
        assert not closing.done()
        p1.release.release()
        p2.release.release()
        while len(p1.batches) + len(p2.batches) < 3:
            await asyncio.sleep(0.001)
        (p1 if len(p1.batches) == 2 else p2).release.release()
        await closing
        return [(await t)[0][:, 0, 0].tolist() for t in ts], sorted(p1.batches + p2.batches)

    got, batches = asyncio.run(asyncio.wait_for(main(), 60))
    assert got == [[1, 2], [3, 4], [5, 6]] and batches == [[1, 2], [3, 4], [5, 6]]


def test_concurrent_batches_config_checks():
    with pytest.raises(ConfigError, match="concurrent_batches"):
        ServeConfig(concurrent_batches=0).validate()
    with pytest.raises(ConfigError, match="policy_process"):
        ServeConfig(concurrent_batches=2, policy_process=True).validate()


def test_a_lane_that_fails_fails_its_batch_only():
    """Two lanes, the second one's predict raises (for seeds 3 and 5): its batch's request gets the error, the other
    lane's batch is answered, and the failed lane takes batches again afterwards (it is free again)."""
    class Failing(GatedPredict):
        def __call__(self, obs, seeds):
            out = super().__call__(obs, seeds)
            if 3 in seeds or 5 in seeds:
                raise RuntimeError("lane 2 broke")
            return out

    async def main():
        p1, p2 = GatedPredict(), Failing()
        b = DynamicBatcher([p1, p2], max_batch_size=2, max_wait_ms=1, max_queue=64)
        await b.start()
        ta = asyncio.create_task(_submit(b, [1, 2]))
        await _wait_started(p1)
        tb = asyncio.create_task(_submit(b, [3, 4]))
        await _wait_started(p2)
        p2.release.release()
        with pytest.raises(RuntimeError, match="lane 2 broke"):
            await tb
        tc = asyncio.create_task(_submit(b, [5, 6]))   # lane 1 still busy: goes to lane 2 again
        await _wait_started(p2)
        p2.release.release()
        with pytest.raises(RuntimeError):
            await tc
        p1.release.release()
        aa, _ = await ta
        p1.release.release()                          # either lane may take the next batch (the first one freed):
        p2.release.release()                          # let both run it
        dd, _ = await _submit(b, [7, 8])
        await b.close()
        return aa, dd, p2.batches

    aa, dd, failed = asyncio.run(asyncio.wait_for(main(), 60))
    assert aa[:, 0, 0].tolist() == [1, 2] and dd[:, 0, 0].tolist() == [7, 8]
    assert failed[:2] == [[3, 4], [5, 6]]


def test_a_request_that_makes_the_policy_fail_fails_alone_not_the_requests_batched_with_it():
    """One client's observation that makes predict raise (found by a probe: an openpi seed of -1 failed four other
    clients' HTTP requests in its batch with 500) fails only its own request: the batch's requests run again one by
    one, each answered with exactly the actions it would get alone."""
    calls: list[list[int]] = []

    def predict(obs, seeds):
        calls.append([int(s) for s in seeds])
        if 99 in seeds:
            raise ValueError("seed 99 is poison")
        return np.asarray(seeds, np.float32)[:, None, None] * np.ones((1, 2, 3), np.float32)

    async def main():
        b = DynamicBatcher(predict, max_batch_size=5, max_wait_ms=60_000, max_queue=64)
        await b.start()
        # 5 observations from three requests: the batch fills (5) and runs at once, all three in it
        good1 = asyncio.create_task(_submit(b, [1, 2]))
        bad = asyncio.create_task(_submit(b, [99]))
        good2 = asyncio.create_task(_submit(b, [3, 4]))
        results = await asyncio.gather(good1, bad, good2, return_exceptions=True)
        await b.close()
        return results

    (a1, _), bad, (a2, _) = asyncio.run(asyncio.wait_for(main(), 60))
    assert calls[0] == [1, 2, 99, 3, 4]                    # one merged batch first
    assert sorted(calls[1:]) == [[1, 2], [3, 4], [99]]     # then each request alone
    assert isinstance(bad, ValueError) and "poison" in str(bad)
    assert a1[:, 0, 0].tolist() == [1, 2] and a2[:, 0, 0].tolist() == [3, 4]


def test_a_failed_batch_of_one_request_is_not_run_again():
    calls: list[list[int]] = []

    def predict(obs, seeds):
        calls.append([int(s) for s in seeds])
        raise RuntimeError("broken policy")

    async def main():
        b = DynamicBatcher(predict, max_batch_size=4, max_wait_ms=1, max_queue=64)
        await b.start()
        try:
            with pytest.raises(RuntimeError, match="broken policy"):
                await _submit(b, [1, 2, 3])
        finally:
            await b.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert calls == [[1, 2, 3]]
