"""`wamkit serve policy_process=true`: the policy in a child process answers exactly what it answers in-process; a bad
policy key is still a one-line UserError; a predict that fails is a 500 and the server keeps serving."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies.simple import FixedCostPolicy
from wamkit.protocol import build_request
from wamkit.serve.app import create_app
from wamkit.serve.config import ServeConfig
from wamkit.serve.policy_process import PolicyProcess

GEN = "/v1/actions/generations"
ARGS = {"base_ms": 1, "per_obs_ms": 0, "horizon": 4, "action_dim": 3}


def _post(c: TestClient, obs, seeds):
    body = build_request(obs, seeds, {}, binary=False)
    return c.post(GEN, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def _actions(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    data = sorted(r.json()["data"], key=lambda d: d["input_index"])
    return np.asarray([d["action"]["values"] for d in data], np.float32)


def test_policy_process_answers_like_in_process():
    obs = [Observation({"image": np.full((8, 8, 3), i, np.uint8)}, None, "t") for i in range(3)]
    got = {}
    for flag in (False, True):
        cfg = ServeConfig(policy="fixed-cost", policy_args=ARGS, warmup=True, log_every_s=0, max_wait_ms=1,
                          policy_process=flag)
        app = create_app(cfg)
        srv = app.state.server
        assert isinstance(srv.policy, PolicyProcess) == flag
        with TestClient(app) as c:
            got[flag] = _actions(_post(c, obs, [5, 6, 7]))
            meta = c.get("/v1/actions/metadata").json()
            assert meta["policy"]["name"] == "fixed-cost" and meta["capabilities"]["max_batch_size"] == 64
        if flag:
            assert not srv.policy._proc.is_alive()          # the lifespan's end closed the child
    assert got[True].shape == (3, 4, 3)
    np.testing.assert_array_equal(got[True], got[False])


def test_policy_process_bad_key_is_a_user_error():
    with pytest.raises(UserError, match="horizn"):
        PolicyProcess("fixed-cost", {"horizn": 4})


def test_policy_process_predict_error_is_a_500_and_serving_goes_on():
    cfg = ServeConfig(policy="fixed-cost", policy_args=ARGS, warmup=False, log_every_s=0, max_wait_ms=1,
                      policy_process=True)
    app = create_app(cfg)
    with TestClient(app) as c:
        proc = app.state.server.policy
        good = [Observation({"image": np.zeros((8, 8, 3), np.uint8)}, None, "t")]
        assert _post(c, good, [1]).status_code == 200
        assert c.get("/health").status_code == 200
        proc._proc.kill()                                   # the child dies: requests fail with 500, and the server
        proc._proc.join(10)                                 # says it is not healthy (a server worker restarts it)
        r = _post(c, good, [2])
        assert r.status_code == 500 and "policy process exited" in r.json()["error"]["message"]
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "policy_process_exited" and h.json()["exit_code"] == -9


def test_a_server_whose_policy_child_died_is_restarted_by_its_worker():
    """The evaluator's promise: a crashed server is restarted. A dead policy child used to leave a process that
    answered /health 200 and every request 500, so ensure_healthy() never restarted it."""
    import asyncio
    import signal

    from processes import descendants
    from wamkit.serve import ActionClient, WamkitServerWorker

    good = [Observation({"image": np.zeros((8, 8, 3), np.uint8)}, None, "t")]

    async def predict(url):
        async with ActionClient(url) as c:
            return await c.predict(good, [1])

    with WamkitServerWorker("fixed-cost", ARGS, max_batch_size=4, max_wait_ms=1,
                            extra_args={"policy_process": True}) as w:
        first = asyncio.run(predict(w.url))
        assert not w.ensure_healthy()
        child = [p for p in descendants(w.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(child) == 1, "the policy child process"
        os.kill(child[0], signal.SIGKILL)
        old_pid = w.pid
        assert w.ensure_healthy()                            # restarted: a new server process
        assert w.pid != old_pid
        np.testing.assert_array_equal(asyncio.run(predict(w.url)), first)


def test_arena_round_trip_and_growth():
    """What the child sees through shared memory is exactly what the parent packed, cameras, state and task; a larger
    batch gets a new (larger) file; no file is left in /dev/shm."""
    from wamkit.serve.policy_process import _Arena, _unpack

    rng = np.random.default_rng(0)

    def obs(n, side):
        return [Observation({"image": rng.integers(0, 256, (side, side, 3), dtype=np.uint8),
                             "wrist": rng.integers(0, 256, (side // 2, side, 3), dtype=np.uint8)},
                            rng.standard_normal(5).astype(np.float32) if i % 2 else None, f"task {i}")
                for i in range(n)]

    arena = _Arena()
    try:
        for batch in (obs(3, 16), obs(2, 16), obs(8, 512)):
            path, layout = arena.pack(batch)
            assert path is None or os.path.exists(path)
            first = arena.mm
            got = _unpack(arena.mm, layout)
            arena.mapped()
            assert path is None or not os.path.exists(path)
            for a, b in zip(batch, got):
                assert a.task == b.task and a.images.keys() == b.images.keys()
                for c in a.images:
                    np.testing.assert_array_equal(a.images[c], b.images[c])
                assert (a.state is None) == (b.state is None)
                if a.state is not None:
                    np.testing.assert_array_equal(a.state, b.state)
            del got
            assert arena.mm is first
        assert arena.size >= 8 * (512 * 512 * 3 + 256 * 512 * 3)
    finally:
        arena.close()


class ArenaWatcher(FixedCostPolicy):
    """A policy (run in the policy process) whose actions say how many of its server's arena files are still named
    in /dev/shm while it predicts."""

    def predict(self, observations, seeds):
        server = os.getppid()
        named = [n for n in os.listdir("/dev/shm") if n.startswith(f"wamkit-policy-{server}_")]
        return np.full((len(observations), self.spec.action.horizon, self.spec.action.dim), len(named), np.float32)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_the_arena_file_is_unlinked_before_predict_and_orphans_are_swept():
    """A probe's finding: the arena file was unlinked by the server after the child's reply, so a server killed
    during a predict (SIGKILL, the OOM killer) left it in /dev/shm for good, under a name no sweep knew. Now the child
    unlinks it once mapped, before predicting (the policy sees none of its server's files, for the first file and for
    a grown one); files named for a dead server are removed when a policy process starts."""
    from wamkit.core.shm_names import owned_name

    stale = Path("/dev/shm") / owned_name("wamkit-policy-").replace(str(os.getpid()), str(2 ** 22 + 12345), 1)
    stale.write_bytes(b"x")
    pp = PolicyProcess("test_serve_policy_process:ArenaWatcher")
    try:
        assert not stale.exists()
        small = [Observation({"image": np.zeros((8, 8, 3), np.uint8)}, None, "t")]
        big = [Observation({"image": np.zeros((512, 512, 3), np.uint8)}, None, "t")] * 8   # > 1 MiB: a new file
        for obs in (small, small, big):
            assert pp.predict(obs, [0] * len(obs)).max() == 0
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"wamkit-policy-{os.getpid()}_")]
    finally:
        pp.close()
        stale.unlink(missing_ok=True)
