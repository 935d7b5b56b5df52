"""inference=inprocess with inprocess_batching=true: requests in flight together go to the policy as one call."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from wamkit.core.config import ConfigError
from wamkit.core.types import Observation
from wamkit.eval.inference import InProcessInference
from wamkit.eval.timeline import Timeline
from wamkit.protocol.messages import observation_key


class _SlowPolicy:
    """Each call takes 50 ms; its actions say which observation (the state's first value) they answer."""

    def __init__(self):
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def max_batch_size(self) -> int:
        return 8

    def warmup(self, n: int) -> None:
        pass

    def predict(self, observations, seeds):
        with self.lock:
            self.calls.append(len(observations))
        time.sleep(0.05)
        return np.stack([np.full((4, 2), o.state[0] + 1000 * s, np.float32) for o, s in zip(observations, seeds)])


def _obs(i: int, size: int = 8) -> Observation:
    return Observation(images={"image": np.zeros((size, size, 3), np.uint8)}, state=np.array([i], np.float32),
                       task="t")


def test_requests_in_flight_together_become_one_policy_call():
    """A lone request goes at once (idle dispatch); three that arrive while it computes leave together after it, as
    one call of 3 (and one of 2 more, a camera of another size, in a call of its own: their key differs); each
    request gets its own observations' actions back. Without batching every request is its own call."""
    pol = _SlowPolicy()

    async def main(batching):
        inf = InProcessInference(pol, Timeline(), batching=batching)
        await inf.start()
        first = asyncio.create_task(inf.predict([_obs(0)], [0]))
        await asyncio.sleep(0.01)        # the first call is computing
        rest = [asyncio.create_task(inf.predict([_obs(i)], [i])) for i in (1, 2, 3)]
        other = asyncio.create_task(inf.predict([_obs(4, 16), _obs(5, 16)], [4, 5]))
        outs = await asyncio.gather(first, *rest, other)
        await inf.close()
        return inf, outs

    inf, outs = asyncio.run(main((8, 2.0)))
    assert inf.merges_requests and sorted(pol.calls[1:]) == [2, 3] and pol.calls[0] == 1
    assert [x.n for x in inf.timeline.spans if x.kind == "compute"] == pol.calls   # each call on the timeline
    assert inf.requests == 5 and inf.observations == 6
    for i, out in enumerate(outs[:4]):
        assert out.shape == (1, 4, 2) and np.all(out == i + 1000 * i)
    assert outs[4].shape == (2, 4, 2) and np.all(outs[4][0] == 4 + 4000) and np.all(outs[4][1] == 5 + 5000)

    pol.calls.clear()
    inf, _ = asyncio.run(main(None))
    assert not inf.merges_requests and pol.calls == [1, 1, 1, 1, 2]


def test_observation_key_separates_what_cannot_share_a_call():
    assert observation_key(_obs(0)) == observation_key(_obs(1))
    assert observation_key(_obs(0)) != observation_key(_obs(0, 16))
    stateless = Observation(images={"image": np.zeros((8, 8, 3), np.uint8)}, state=None, task="t")
    assert observation_key(_obs(0)) != observation_key(stateless)


def test_inprocess_batching_is_refused_with_a_server():
    from wamkit.eval.config import EvalConfig

    with pytest.raises(ConfigError, match="inprocess_batching"):
        EvalConfig(inference="server", inprocess_batching=True).validate()
