"""ServerInference with several real `wamkit serve` processes: what each replica is started with, and least-loaded
dispatch."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from wamkit.core.config import load_config
from wamkit.core.types import Observation
from wamkit.eval.config import EvalConfig
from wamkit.eval.inference import ServerInference

ARGS = {"per_obs_ms": 0, "action_dim": 2, "horizon": 2}


def obs(n: int) -> list[Observation]:
    rng = np.random.default_rng(n)
    return [Observation({"image": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)}, None, "t") for _ in range(n)]


def test_replicas_get_their_gpu_and_the_serve_args():
    cfg = load_config(EvalConfig, None, ["server.replicas=2", "server.gpus=3,5", "server.serve_args.torch_threads=1"])
    inf = ServerInference(policy="fixed-cost", policy_args={**ARGS, "base_ms": 1}, options=cfg.server)

    async def main():
        await inf.start()
        try:
            assert [w.env["CUDA_VISIBLE_DEVICES"] for w in inf.workers] == ["3", "5"]
            assert all("torch_threads=1" in w.command() for w in inf.workers)
            assert all("idle_dispatch=True" in w.command() for w in inf.workers)   # ServerOptions' default
            assert len({w.url for w in inf.workers}) == 2
            a = await inf.predict(obs(3), [1, 2, 3])
            assert a.shape == (3, 2, 2)
        finally:
            await inf.close()

    asyncio.run(main())
    for w in inf.workers:   # both stopped, nothing left behind
        with pytest.raises(ProcessLookupError):
            os.kill(w.pid, 0)


def test_requests_go_to_the_least_loaded_server():
    """Server 0 takes 1 s per batch, server 1 5 ms: while server 0 holds 4 observations, the next single
    observations all go to server 1."""
    from wamkit.serve.workers import WamkitServerWorker

    with WamkitServerWorker("fixed-cost", {**ARGS, "base_ms": 1000}) as slow, \
            WamkitServerWorker("fixed-cost", {**ARGS, "base_ms": 5}) as fast:
        cfg = load_config(EvalConfig, None, [f"server.url={slow.url},{fast.url}"])
        inf = ServerInference(policy="fixed-cost", policy_args={}, options=cfg.server)

        async def main():
            await inf.start()
            try:
                first = asyncio.create_task(inf.predict(obs(4), [0, 1, 2, 3]))   # tie: server 0
                await asyncio.sleep(0.05)
                for k in range(5):
                    await inf.predict(obs(1), [10 + k])
                await first
            finally:
                await inf.close()

        asyncio.run(main())
    assert inf.served == [1, 5] and inf.in_flight == [0, 0]


def test_auto_protocol_is_the_websocket_for_servers_started_here_only():
    from wamkit.eval.inference import LOCAL_SERVE_PROTOCOL, resolve_protocol

    def resolved(*over):
        return resolve_protocol(load_config(EvalConfig, None, list(over)).server, None)

    assert resolved() == LOCAL_SERVE_PROTOCOL == "sglang-ws"              # launch=wamkit, no url
    assert resolved("server.protocol=wamkit") == "wamkit"                 # HTTP on request
    assert resolved("server.url=http://h:8000") == "wamkit"               # a running server: HTTP, as before
    assert resolved("server.launch=sglang", "server.sglang.model_path=/m") == "wamkit"
    assert resolved("server.url=ws://h:8000", "server.protocol=openpi") == "openpi"


def test_auto_protocol_stays_on_http_without_websockets(monkeypatch):
    """An environment without the `websockets` package (wheels carried by hand) evaluates over HTTP under auto
    instead of failing at the first request; an explicit websocket protocol is still taken as asked."""
    from wamkit.eval import inference as I

    monkeypatch.setattr(I, "_websockets_available", lambda: False)
    assert I.resolve_protocol(load_config(EvalConfig, None, []).server, None) == "wamkit"
    assert I.resolve_protocol(load_config(EvalConfig, None, ["server.protocol=sglang-ws"]).server, None) == "sglang-ws"


@pytest.mark.parametrize("protocol", ["auto", "wamkit"])
def test_attached_server_is_restarted_and_left_running(protocol):
    """Servers the caller started (bench eval's shared ones): used as they are, restarted by the client when killed
    mid-run, between requests or with a request in flight (restarts counted for this run only; the request retried,
    same actions), and still running after close. auto: the websocket (its pooled connection dies with the server)."""
    import signal

    from wamkit.serve.workers import WamkitServerWorker

    with WamkitServerWorker("fixed-cost", {**ARGS, "base_ms": 1}) as w:
        cfg = load_config(EvalConfig, None, [f"server.protocol={protocol}"])
        for run in range(2):
            inf = ServerInference(policy="fixed-cost", policy_args={}, options=cfg.server, workers=[w])
            assert inf.protocol == ("sglang-ws" if protocol == "auto" else "wamkit")

            async def main():
                await inf.start()
                try:
                    assert inf.workers == [w] and inf.restarts == 0
                    a = await inf.predict(obs(2), [1, 2])
                    if run == 0:
                        os.killpg(w.pid, signal.SIGKILL)
                        b = await inf.predict(obs(2), [1, 2])   # the client restarts the server, then retries
                        np.testing.assert_array_equal(a, b)
                        w.stop()                                  # now a slow one, killed with a request in flight
                        w.policy_args = {**ARGS, "base_ms": 1000}
                        w.start()
                        w.wait_healthy(60)
                        pending = asyncio.ensure_future(inf.predict(obs(2), [1, 2]))
                        await asyncio.sleep(0.3)
                        assert not pending.done()
                        os.killpg(w.pid, signal.SIGKILL)
                        np.testing.assert_array_equal(await pending, a)
                finally:
                    await inf.close()

            asyncio.run(main())
            assert inf.restarts == (3 if run == 0 else 0)         # 2 kills + the restart with the slow policy
            assert w.healthy()                                    # close left it running


class _MovingWorker:
    """A server whose replacement listens on another port (a Ray actor re-created elsewhere, session 30's probe):
    the ServerWorker surface the clients use."""

    def __init__(self):
        from wamkit.serve.workers import WamkitServerWorker

        self._make = lambda: WamkitServerWorker("fixed-cost", {**ARGS, "base_ms": 1})
        self.w, self.starts = self._make().start(), 1

    url = property(lambda self: self.w.url)
    pid = property(lambda self: self.w.pid)

    def wait_healthy(self, timeout):
        return self.w.wait_healthy(timeout)

    def healthy(self):
        return self.w.healthy()

    def ensure_healthy(self, timeout=None):
        if self.w.healthy():
            return False
        self.w.stop()
        self.w = self._make().start()
        self.w.wait_healthy(60)
        self.starts += 1
        return True

    def stop(self):
        self.w.stop()


@pytest.mark.parametrize("protocol", ["auto", "wamkit"])
def test_a_restarted_server_on_another_address_is_followed(protocol):
    """The client asks a worker that stopped answering to restart it, then sends to the worker's url (it kept the
    old one: under Ray the replacement actor listens on a new port, and the run died after its retries)."""
    import signal

    mw = _MovingWorker()
    try:
        cfg = load_config(EvalConfig, None, [f"server.protocol={protocol}"])
        inf = ServerInference(policy="fixed-cost", policy_args={}, options=cfg.server, workers=[mw])

        async def main():
            await inf.start()
            try:
                a = await inf.predict(obs(2), [1, 2])
                old = mw.url
                os.killpg(mw.pid, signal.SIGKILL)
                b = await inf.predict(obs(2), [1, 2])
                assert mw.url != old and inf.clients[0].url.split("//")[1].startswith(mw.url.split("//")[1])
                np.testing.assert_array_equal(a, b)
            finally:
                await inf.close()

        asyncio.run(main())
        assert inf.restarts == 1
    finally:
        mw.stop()


def test_sglang_launch_builds_one_server_per_gpu_and_guards_the_stats(tmp_path):
    """server.launch=sglang: one `sglang serve` per GPU with the server options (the command line is checked, the
    process is not run: SGLang needs a GPU); server-side stats need normalization=server, and the reverse."""
    from wamkit.core.errors import UserError
    from wamkit.eval.inference import check_normalization, server_policy, start_server_workers
    from wamkit.policies import make_policy
    from wamkit.serve.workers import SGLangServerWorker

    started = []

    class NotRun(SGLangServerWorker):
        def start(self):
            started.append(self)
            return self

        def wait_healthy(self, timeout=None, poll_s=0.2):
            return self

    stats = tmp_path / "stats.json"
    stats.write_text('{"q01": [0,0,0,0,0,0,0,0,0,0], "q99": [1,1,1,1,1,1,1,1,1,1]}')
    cfg = load_config(EvalConfig, None, ["server.launch=sglang", "server.replicas=2", "server.gpus=0,1",
                                         "server.max_batch_size=8", "server.sglang.model_path=/models/c3",
                                         f"server.sglang.action_stats_path={stats}"])
    workers = start_server_workers("cosmos3", {}, cfg.server, worker_factory=NotRun)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0", "1"] and started == workers
    cmd = workers[0].command()
    assert cmd[cmd.index("--batching-max-size") + 1] == "8" and "--pipeline-config-path" in cmd
    assert '"action_stats_path"' in workers[0].pipeline_config_path.read_text()
    client = make_policy("cosmos3", action_stats=str(stats)).remote_codec()
    with pytest.raises(UserError, match="normalization=server"):
        check_normalization(cfg.server, client)                          # both would denormalize
    check_normalization(cfg.server, make_policy("cosmos3", normalization="server").remote_codec())
    no_stats = load_config(EvalConfig, None, ["server.launch=sglang", "server.sglang.model_path=/m"]).server
    with pytest.raises(UserError, match="action_stats_path"):
        check_normalization(no_stats, make_policy("cosmos3", normalization="server").remote_codec())
    with pytest.raises(UserError, match="model_path"):
        start_server_workers("cosmos3", {}, load_config(EvalConfig, None, ["server.launch=sglang"]).server,
                             worker_factory=NotRun)
    wamkit_launch = load_config(EvalConfig, None, []).server
    with pytest.raises(UserError, match="cosmos3-standin"):
        server_policy("cosmos3", {}, wamkit_launch, client)              # cosmos3 cannot run in `wamkit serve`
    standin = load_config(EvalConfig, None, ["server.policy=cosmos3-standin"]).server
    assert server_policy("cosmos3", {"action_stats": "s.json"}, standin, client) == (
        "cosmos3-standin", {"action_stats": "s.json"})                    # the stand-in gets the adapter's stats


def test_a_server_workers_temporary_log_goes_with_a_clean_with_block_and_stays_after_a_failure():
    """A probe's finding: every WamkitServerWorker made without log_path left its /tmp log behind (46 of them from
    earlier test runs). A `with` block that ends without error removes it; one that fails keeps it (it says why);
    a log the caller named is never removed."""
    from pathlib import Path

    from wamkit.serve.workers import WamkitServerWorker

    with WamkitServerWorker("zero") as w:
        temp = w.log_path
        assert temp.exists() and "wamkit-server-" in temp.name
    assert not temp.exists()
    with pytest.raises(KeyError):
        with WamkitServerWorker("zero") as w:
            kept = w.log_path
            raise KeyError("the caller's failure")
    assert kept.exists()
    kept.unlink()
    named = Path(os.environ.get("TMPDIR", "/tmp")) / f"wamkit-named-{os.getpid()}.log"
    with WamkitServerWorker("zero", log_path=named):
        pass
    assert named.exists()
    named.unlink()


@pytest.mark.parametrize("protocol", ["auto", "wamkit"])
def test_the_horizon_asked_reaches_the_server_without_the_policys_arguments(protocol):
    """A review's finding: eval builds an export without `horizon` (its network is trained for its own chunk), and
    the server path read the horizon from the policy's arguments only: `horizon=` was silently dropped. The server
    (horizon 4 here) is asked for, and cut to, the eval's horizon."""
    from wamkit.serve.workers import WamkitServerWorker

    with WamkitServerWorker("fixed-cost", {**ARGS, "base_ms": 1, "horizon": 4}) as w:
        cfg = load_config(EvalConfig, None, [f"server.protocol={protocol}"])
        got = {}
        for horizon in (None, 3):
            inf = ServerInference(policy="fixed-cost", policy_args={}, options=cfg.server, workers=[w],
                                  horizon=horizon)

            async def main():
                await inf.start()
                try:
                    return await inf.predict(obs(2), [1, 2])
                finally:
                    await inf.close()

            got[horizon] = asyncio.run(main())
    assert got[None].shape == (2, 4, 2) and got[3].shape == (2, 3, 2)
    np.testing.assert_array_equal(got[3], got[None][:, :3])


def test_served_policies_compare_their_export_by_its_directorys_name():
    """A review's finding: servers now report model_path relative to their working directory (never absolute), so a
    run recorded before (absolute) or a server started elsewhere no longer matched, and resume was refused."""
    from wamkit.eval.inference import _same_served

    old = {"name": "wam-ref", "model_path": "/home/u/runs/export/wam-ref-libero"}
    assert _same_served(old, {"name": "wam-ref", "model_path": "runs/export/wam-ref-libero"})
    assert _same_served(old, {"name": "wam-ref", "model_path": "wam-ref-libero"})
    assert _same_served(old, {"name": "wam-ref"})                             # a server that does not say
    assert not _same_served(old, {"name": "wam-ref", "model_path": "runs/export/wam-ref-metaworld"})
    assert not _same_served(old, {"name": "pi0", "model_path": "wam-ref-libero"})


def test_the_call_latencies_kept_are_the_recent_ones_and_bounded(monkeypatch):
    """Inference.latencies held every call of a run (~100 bytes each, to the end): now the KEPT_LATENCIES most
    recent, the latest last, which covers all the planner reads (its last 100)."""
    from types import SimpleNamespace

    import wamkit.eval.inference as inference_mod
    from wamkit.eval.inference import InProcessInference
    from wamkit.policies import make_policy

    monkeypatch.setattr(inference_mod, "KEPT_LATENCIES", 5)
    inf = InProcessInference(make_policy("fixed-cost", **{**ARGS, "base_ms": 0}))
    inf.prepare(SimpleNamespace(action_dim=2, max_steps=0))

    async def main():
        await inf.start()
        try:
            sizes = []
            for k in range(23):
                n = 1 + k % 3
                await inf.predict(obs(n), list(range(n)))
                sizes.append(n)
                assert len(inf.latencies) < 10 and [b for b, _ in inf.latencies] == sizes[-len(inf.latencies):]
            assert inf.requests == 23 and inf.observations == sum(sizes) and len(inf.latencies) >= 5
        finally:
            await inf.close()

    asyncio.run(main())
