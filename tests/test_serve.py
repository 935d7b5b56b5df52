"""Action server end to end: real `wamkit serve` subprocesses on loopback, real HTTP, the async client.

No test depends on a timing threshold: batching is forced by a long max_wait_ms with a batch size that fills exactly,
and the shutdown/queue tests wait on /metrics counters, not on sleeps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import msgpack
import numpy as np
import pytest
from processes import running

from wamkit.core.types import Observation
from wamkit.policies import make_policy
from wamkit.protocol import build_request, encode_body, encode_image
from wamkit.serve import ActionClient, ActionClientError, SyncActionClient, WamkitServerWorker

TOKEN = "s3cret-token"
POLICY_ARGS = {"base_ms": 2, "per_obs_ms": 0, "action_dim": 7, "horizon": 8}
GEN = "/v1/actions/generations"


def make_obs(n: int, cams=("image", "wrist_image"), side=16, state=True) -> list[Observation]:
    rng = np.random.default_rng(n)
    return [Observation({c: rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for c in cams},
                        rng.standard_normal(9).astype(np.float32) if state else None, f"task {i % 3}")
            for i in range(n)]


def reference(seeds) -> np.ndarray:
    """What the fixed-cost policy answers, computed locally (it depends only on the seeds)."""
    pol = make_policy("fixed-cost", **{**POLICY_ARGS, "base_ms": 0})
    return pol.predict([None] * len(seeds), seeds)


@pytest.fixture(scope="module")
def server():
    w = WamkitServerWorker("fixed-cost", POLICY_ARGS, max_batch_size=8, max_wait_ms=2, token=TOKEN,
                           extra_args={"max_body_mb": 1, "max_queue": 64})
    with w:
        pid = w.pid
        yield w
    assert not running(pid), "server outlived its test"


def auth():
    return {"authorization": f"Bearer {TOKEN}"}


def post(server, body: bytes, ctype: str, headers=None) -> httpx.Response:
    return httpx.post(server.url + GEN, content=body, headers={"content-type": ctype, **auth(), **(headers or {})},
                      timeout=30)


def test_health_metadata_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "instance_id": server.instance_id}  # no token
    md = httpx.get(server.url + "/v1/actions/metadata", headers=auth()).json()
    assert md["object"] == "action.metadata" and md["capabilities"]["max_batch_size"] == 8
    assert md["output"]["action_horizon"] == 8 and md["output"]["action_dim"] == 7 and md["policy"]["name"] == \
        "fixed-cost"
    m = httpx.get(server.url + "/metrics", headers=auth()).json()
    assert {"counts", "batch_size_histogram", "queue_ms", "compute_ms"} <= set(m)


def test_json_roundtrip(server):
    obs = make_obs(3, cams=("image",), state=False)
    body = build_request(obs, [11, 12, 13], {"raw_action_dim": 5}, binary=False)
    r = post(server, json.dumps(body).encode(), "application/json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    j = r.json()
    assert j["object"] == "action.generation" and [d["input_index"] for d in j["data"]] == [0, 1, 2]
    a = np.array([d["action"]["values"] for d in j["data"]], np.float32)
    assert np.array_equal(a, reference([11, 12, 13])[:, :, :5])
    assert set(j["timing"]) >= {"queue_ms", "compute_ms", "batch_size", "t_start", "t_end"}
    assert j["usage"] == {"batch_size": 3, "action_horizon": 8, "action_dim": 5, "denoise_steps": 0,
                          "prefix_cache_hit": False}     # SGLang's usage fields


def test_msgpack_roundtrip_multi_camera(server):
    obs = make_obs(5)
    data, ct = encode_body(build_request(obs, [1, 2, 3, 4, 5]), True)
    r = post(server, data, ct)
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    j = msgpack.unpackb(r.content, raw=False)
    vals = j["data"][0]["action"]["values"]
    assert vals[b"__ndarray__"] and vals[b"dtype"] == "<f4"  # SGLang's array marker, keys packed as bytes as SGLang's
    a = np.stack([np.frombuffer(d["action"]["values"][b"data"], np.float32).reshape(8, 7) for d in j["data"]])
    assert np.array_equal(a, reference([1, 2, 3, 4, 5]))


def test_client_batch_of_n_in_order_and_split_over_max_batch(server):
    obs = make_obs(19)  # > max_batch_size=8: three requests, sent concurrently
    seeds = list(range(100, 119))
    with SyncActionClient(server.url, token=TOKEN) as c:
        a = c.predict(obs, seeds)
        assert a.shape == (19, 8, 7) and np.array_equal(a, reference(seeds))
        assert sorted(t["n"] for t in c.last_timings) == [3, 8, 8]
        assert all(t["server"]["batch_size"] >= 1 for t in c.last_timings)


def test_client_postprocess_and_raw_action_dim(server):
    async def go():
        async with ActionClient(server.url, token=TOKEN, postprocess=lambda x: x * 10.0,
                                parameters={"raw_action_dim": 6}) as c:
            return await c.predict(make_obs(2), [5, 6])
    a = asyncio.run(go())
    assert np.allclose(a, reference([5, 6])[:, :, :6] * 10.0)


BAD_CASES = [
    # (name, body, content-type, status, words in the message)
    ("missing field", {"input": {"task": "x"}}, "json", 400, "input.image"),
    ("unknown field", {"input": {"image": [[[1, 2, 3]]]}, "extra": 1}, "json", 400, "extra: unknown field"),
    ("wrong dtype", {"input": {"image": {"dtype": "float32", "shape": [2, 2, 3], "bytes": b"\0" * 48}}}, "msgpack",
     400, "input.image.dtype"),
    ("wrong shape", {"input": {"image": [encode_image(np.zeros((4, 4, 3), np.uint8), "raw"),
                                         {"dtype": "uint8", "shape": [4, 4, 4], "bytes": b"\0" * 64}]}},
     "msgpack", 400, "input.image[1].shape"),
    ("too long horizon", {"input": {"image": [[[1, 2, 3]]]}, "parameters": {"action_horizon": 64}}, "json", 422,
     "parameters.action_horizon"),
    ("model not a string", {"model": {"a": [1]}, "input": {"image": [[[1, 2, 3]]]}}, "json", 400,
     "model: expected a string"),
    ("model too long", {"model": "m" * 20000, "input": {"image": [[[1, 2, 3]]]}}, "json", 400,
     "model: longer than"),
]


@pytest.mark.parametrize("name, body, kind, status, words", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_malformed_requests_get_4xx_and_server_stays_healthy(server, name, body, kind, status, words):
    data, ct = encode_body(body, kind == "msgpack")
    r = post(server, data, ct)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"], r.json()
    assert server.healthy()


def test_unknown_routes_and_wrong_methods_answer_the_json_error_layout(server):
    """Starlette's own 404/405 were text/plain; every refusal uses the one layout (serve.errors.error_response)."""
    for method, path, status, words in [("GET", "/v1/nope", 404, "no such route: /v1/nope"),
                                         ("GET", GEN, 405, f"method GET not allowed on {GEN} (allowed: POST)"),
                                         ("POST", "/health", 405, "not allowed on /health")]:
        r = httpx.request(method, server.url + path, headers=auth())
        assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
        err = r.json()["error"]
        assert err["code"] == status and words in err["message"] and r.json()["detail"] == err["message"]
        assert status == 404 or r.headers["allow"]


def test_json_response_has_lists_also_when_numpy_output_is_asked(server):
    """runtime.output_format=numpy means SGLang's binary array marker, which only msgpack carries: a JSON response
    holds lists whatever was asked, as SGLang answers (docs/serving.md, Request)."""
    body = build_request(make_obs(1, cams=("image",), state=False), [11], binary=False)
    body["runtime"]["output_format"] = "numpy"
    r = post(server, json.dumps(body).encode(), "application/json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    values = r.json()["data"][0]["action"]["values"]
    assert np.array_equal(np.array(values, np.float32), reference([11])[0])


def test_non_msgpack_bytes_bad_token_and_body_cap(server):
    r = post(server, b"\xc1\xc1 definitely not msgpack", "application/msgpack")
    assert r.status_code == 400 and "msgpack" in r.json()["detail"]
    r = httpx.post(server.url + GEN, content=b"{}", headers={"content-type": "application/json",
                                                            "authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(server.url + GEN, content=b"{}", headers={"content-type": "application/json"})
    assert r.status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    big = build_request(make_obs(1, side=700, state=False), [0])  # ~1.5 MB > max_body_mb=1
    data, ct = encode_body(big, True)
    r = post(server, data, ct)
    assert r.status_code == 413 and "cap" in r.json()["detail"]
    # a chunked upload without content-length is capped while streaming
    r = httpx.post(server.url + GEN, content=iter([data[i:i + 65536] for i in range(0, len(data), 65536)]),
                   headers={"content-type": ct, **auth()})
    assert r.status_code == 413
    with SyncActionClient(server.url, token=TOKEN) as c:
        with pytest.raises(ActionClientError) as e:
            c.predict(make_obs(1), [0], {"action_mode": "forward_dynamics"})
        assert e.value.status == 422
        assert c.predict(make_obs(1), [0]).shape == (1, 8, 7)  # still serving
    assert server.healthy()


def test_concurrent_clients_are_batched_and_each_gets_its_own_answer(server):
    """20 clients, one observation each: max_batch_size=20 and a long max_wait_ms make the server wait for all 20,
    so they share one batch, deterministically. Each answer equals what the same request gets alone."""
    n = 20
    obs = make_obs(n)
    seeds = [1000 + 7 * i for i in range(n)]
    with WamkitServerWorker("fixed-cost", {**POLICY_ARGS, "base_ms": 50}, max_batch_size=n,
                            max_wait_ms=60000) as w:
        async def go():
            clients = [ActionClient(w.url) for _ in range(n)]
            try:
                return await asyncio.gather(*(c.predict([obs[i]], [seeds[i]]) for i, c in enumerate(clients))), \
                    [c.last_timings[0] for c in clients]
            finally:
                for c in clients:
                    await c.aclose()
        outs, timings = asyncio.run(go())
        m = httpx.get(w.url + "/metrics").json()
        pid = w.pid
    assert not running(pid)
    assert m["max_batch_size_seen"] == n and m["batch_size_histogram"] == {str(n): 1}
    assert all(t["server"]["batch_size"] == n for t in timings)
    with SyncActionClient(server.url, token=TOKEN) as c:      # the same requests alone (max_wait 2 ms server)
        alone = [c.predict([obs[i]], [seeds[i]]) for i in range(n)]
    for i in range(n):
        assert np.array_equal(outs[i], alone[i]) and np.array_equal(outs[i][0], reference([seeds[i]])[0])


def _wait_for(pred, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_queue_full_503_then_sigterm_finishes_in_flight_work():
    """A 2-observation request waits in the queue (max_wait 60 s, batch 64); a third observation overflows
    max_queue=2 -> 503 + Retry-After; SIGTERM then runs the queued work, answers it, and the server exits."""
    w = WamkitServerWorker("fixed-cost", POLICY_ARGS, max_batch_size=64, max_wait_ms=60000,
                           extra_args={"max_queue": 2})
    with w:
        obs = make_obs(2)
        data, ct = encode_body(build_request(obs, [3, 4]), True)

        async def go():
            async with httpx.AsyncClient(base_url=w.url, timeout=60) as h:
                inflight = asyncio.create_task(h.post(GEN, content=data, headers={"content-type": ct}))

                def queued():
                    return httpx.get(w.url + "/metrics").json()["queued"] == 2
                await asyncio.to_thread(_wait_for, queued, "2 observations queued")
                d1, _ = encode_body(build_request(make_obs(1), [0]), True)
                busy = await h.post(GEN, content=d1, headers={"content-type": ct})
                assert busy.status_code == 503 and int(busy.headers["retry-after"]) >= 1
                too_many, _ = encode_body(build_request(make_obs(3), [0, 1, 2]), True)
                r413 = await h.post(GEN, content=too_many, headers={"content-type": ct})
                assert r413.status_code == 413
                os.killpg(w.pid, signal.SIGTERM)
                return await inflight
        r = asyncio.run(go())
        assert r.status_code == 200
        j = msgpack.unpackb(r.content, raw=False)
        a = np.stack([np.frombuffer(d["action"]["values"][b"data"], np.float32).reshape(8, 7) for d in j["data"]])
        assert np.array_equal(a, reference([3, 4]))
        assert w.proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after its graceful exit
        pid = w.pid
    assert not running(pid)


def test_sigterm_answers_the_websocket_frame_in_flight_before_closing():
    """As for HTTP above, over SGLang's realtime websocket: a frame waiting in the queue when SIGTERM comes is
    computed and answered, then the connection closes (uvicorn closed websockets at once with 1012: no reply, while
    the batch was still computed)."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from wamkit.protocol.openpi import packb, unpackb

    w = WamkitServerWorker("fixed-cost", POLICY_ARGS, max_batch_size=64, max_wait_ms=60000)
    with w:
        obs = make_obs(2)
        body = build_request(obs, [3, 4], binary=True)
        with connect(f"ws://{w.host}:{w.port}/v1/actions/realtime", max_size=None, open_timeout=30) as ws:
            ws.recv()                                                        # the metadata frame
            ws.send(packb(body))
            _wait_for(lambda: httpx.get(w.url + "/metrics").json()["queued"] == 2, "the frame's 2 observations queued")
            os.killpg(w.pid, signal.SIGTERM)
            reply = unpackb(ws.recv(timeout=30))
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=30)
        got = sorted(reply["data"], key=lambda d: d["input_index"])
        a = np.stack([np.frombuffer(d["action"]["values"]["data"], np.float32).reshape(8, 7) for d in got])
        assert np.array_equal(a, reference([3, 4]))
        assert w.proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_killed_server_is_restarted_by_its_worker_and_retry_succeeds():
    with WamkitServerWorker("fixed-cost", POLICY_ARGS, max_batch_size=4) as w:
        url, pid1 = w.url, w.pid
        with SyncActionClient(w.url, retries=6, backoff=0.05, worker=w) as c:
            first = c.predict(make_obs(2), [1, 2])
            os.kill(pid1, signal.SIGKILL)
            w.proc.wait(timeout=10)
            assert not w.healthy()
            again = c.predict(make_obs(2), [1, 2])   # connection refused -> worker restarts -> retry succeeds
            assert c.last_timings[0]["attempts"] >= 2
        assert np.array_equal(first, again) and w.url == url and w.pid != pid1 and w.starts == 2
        pid2 = w.pid
    assert not running(pid1) and not running(pid2)


def test_explicit_restart_and_stop_are_idempotent():
    w = WamkitServerWorker("zero", {"action_dim": 3, "horizon": 4})
    w.start().wait_healthy(60)
    p1 = w.pid
    w.restart()
    p2 = w.pid
    assert p1 != p2 and w.healthy() and not running(p1)
    w.stop()
    w.stop()
    assert not running(p2) and not w.running()


def test_cli_rejects_unknown_keys():
    from wamkit.cli.main import main
    assert main(["serve", "polcy=random"]) == 2


def test_concurrent_batches_overlap_and_answer_as_one_lane_does():
    """`wamkit serve concurrent_batches=2` with wam-ref (a replica with its own engine on the second lane): six
    clients at once, batches of one. Two batches compute at the same time (their server-side intervals overlap),
    each answer equals the local policy's, and metadata says 2. A policy without replica() is refused at start."""
    from wamkit.serve.workers import ServerStartError

    args = {"size": "tiny", "num_inference_steps": 2, "device": "cpu"}
    n = 6
    obs = make_obs(n, side=64, state=False)
    seeds = [11 * i + 3 for i in range(n)]
    with WamkitServerWorker("wam-ref", args, max_batch_size=1, max_wait_ms=1,
                            extra_args={"concurrent_batches": 2, "torch_threads": 1}) as w:
        w.wait_healthy(300)

        async def go():
            clients = [ActionClient(w.url) for _ in range(n)]
            try:
                outs = await asyncio.gather(*(c.predict([obs[i]], [seeds[i]]) for i, c in enumerate(clients)))
                return outs, [c.last_timings[0]["server"] for c in clients]
            finally:
                for c in clients:
                    await c.aclose()
        outs, timings = asyncio.run(go())
        meta = httpx.get(w.url + "/v1/actions/metadata").json()
    spans = sorted((t["t_start"], t["t_end"]) for t in timings)
    assert any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:])), spans   # some two batches overlapped
    assert meta["server"]["concurrent_batches"] == 2
    local = make_policy("wam-ref", **args)
    for i in range(n):
        np.testing.assert_allclose(outs[i], local.predict([obs[i]], [seeds[i]]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ServerStartError, match="cannot compute two batches at once"):
        with WamkitServerWorker("zero", {}, extra_args={"concurrent_batches": 2}) as w:
            w.wait_healthy(60)
