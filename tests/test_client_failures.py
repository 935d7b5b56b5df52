"""The evaluation's action client against servers that misbehave (a stdlib HTTP server scripted per test): every
failure is one line naming the server (RunError: the CLI prints it, exit 1; 401/403 a UserError, exit 2), a server
that is away for a while is waited for (server.retry_s) while a failing policy is not, Retry-After is capped, and
redirects and bad metadata are named. Found by a probe of the client (session 30)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from wamkit.core.errors import RunError, UserError
from wamkit.core.types import Observation
from wamkit.protocol import build_response, decode_body, parse_request
from wamkit.protocol.client import RETRY_AFTER_MAX_S, ActionAuthError, ActionClient, ActionClientError


class _Script(BaseHTTPRequestHandler):
    """Answers per the server's `script(handler, method) -> None | (status, headers, body bytes)`; None: a valid
    answer of 2 x 4 zeros per observation (metadata: max batch 4)."""

    def log_message(self, *a):
        pass

    def _answer(self, method: str):
        srv = self.server
        body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else b""
        srv.seen.append((method, self.path))
        if body:
            srv.bodies.append(decode_body(body, self.headers.get("content-type")))
        out = srv.script(self, method)
        if out is None:
            if method == "GET":
                out = (200, {"content-type": "application/json"},
                       json.dumps({"capabilities": {"max_batch_size": 4}}).encode())
            else:
                req = parse_request(decode_body(body, self.headers.get("content-type")))
                resp = build_response(req, np.zeros((len(req), 2, 4), np.float32), "fake", False)
                out = (200, {"content-type": "application/json"}, json.dumps(resp).encode())
        status, headers, data = out
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer("GET")

    def do_POST(self):
        self._answer("POST")


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Script)
    srv.seen, srv.bodies, srv.script = [], [], lambda h, m: None
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def _obs(n=1):
    return [Observation(images={"image": np.zeros((8, 8, 3), np.uint8)}, state=np.zeros(3, np.float32), task="t")
            for _ in range(n)]


def _predict(url, n=1, **kw):
    async def go():
        async with ActionClient(url, backoff=0.01, backoff_max=0.05, **kw) as c:
            return await c.predict(_obs(n), list(range(n)))
    return asyncio.run(go())


def _json(status, obj, **headers):
    return status, {"content-type": "application/json", **headers}, json.dumps(obj).encode()


def test_a_good_server_answers(server):
    assert _predict(server.url, 3).shape == (3, 2, 4)


def test_unusable_answers_are_run_errors_naming_the_server(server):
    def nan(h, m):
        if m == "POST":
            return _json(200, {"id": "x", "object": "action", "data": [
                {"index": 0, "input_index": 0, "action": {"shape": [2, 4], "values": [[float("nan")] * 4] * 2}}]})
    server.script = nan
    with pytest.raises(ActionClientError) as e:
        _predict(server.url)
    assert isinstance(e.value, RunError) and not isinstance(e.value, UserError)
    assert str(e.value).startswith(server.url) and "\n" not in str(e.value)


def test_a_wrong_token_is_a_user_error_with_the_setting_to_check(server):
    server.script = lambda h, m: _json(401, {"error": {"message": "missing or invalid bearer token"}})
    with pytest.raises(ActionAuthError) as e:
        _predict(server.url, token="wrong")
    assert isinstance(e.value, UserError) and "server.token" in str(e.value) and server.url in str(e.value)
    assert len(server.seen) == 1                                          # not retried


@pytest.mark.parametrize("body", [b"<html>oops</html>", b"[]"])
def test_metadata_that_is_not_metadata_is_named(server, body):
    server.script = lambda h, m: (200, {"content-type": "text/html" if body[:1] == b"<" else "application/json"},
                                  body) if m == "GET" else None
    with pytest.raises(ActionClientError, match="metadata did not answer the action server's metadata"):
        _predict(server.url)


def test_junk_in_the_metadata_is_named(server):
    server.script = lambda h, m: _json(200, {"capabilities": {"max_batch_size": "lots"}}) if m == "GET" else None
    with pytest.raises(ActionClientError, match="capabilities.max_batch_size must be a positive integer"):
        _predict(server.url)


def test_a_redirect_is_named_and_not_followed(server):
    server.script = lambda h, m: (307, {"location": "/elsewhere"}, b"")
    with pytest.raises(ActionClientError, match="redirect to /elsewhere"):
        _predict(server.url)
    assert len(server.seen) == 1


def test_retry_after_is_capped():
    c = ActionClient("http://127.0.0.1:9")
    assert c._delay(0, 3600.0) <= RETRY_AFTER_MAX_S + 0.1
    assert 1.0 <= c._delay(0, 1.0) <= 1.1


def test_a_server_away_for_a_while_is_waited_for_within_retry_s(server):
    """503s (the server restarting) for ~1 s: retries=1 alone gives up, retry_s=10 waits it out."""
    t_back = time.monotonic() + 1.0
    server.script = lambda h, m: _json(503, {"error": {"message": "starting"}}) if time.monotonic() < t_back else None
    with pytest.raises(ActionClientError, match=r"failed after 2 attempts over .* s: 503: starting"):
        _predict(server.url, retries=1, max_request_size=4)
    t_back = time.monotonic() + 1.0
    assert _predict(server.url, retries=1, retry_s=10, max_request_size=4).shape == (1, 2, 4)


def test_a_failing_policy_is_not_retried_for_retry_s(server):
    """A 500 (the policy failed) is retried `retries` times only: retry_s is for a server that is away."""
    server.script = lambda h, m: _json(500, {"error": {"message": "boom"}}) if m == "POST" else None
    t0 = time.monotonic()
    with pytest.raises(ActionClientError, match="failed after 3 attempts"):
        _predict(server.url, retries=2, retry_s=60)
    assert time.monotonic() - t0 < 30
    assert sum(1 for m, _ in server.seen if m == "POST") == 3


def test_a_server_that_is_not_there_is_named_with_the_exception_type():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ActionClientError) as e:
        _predict(f"http://127.0.0.1:{port}", retries=1, max_request_size=1)
    msg = str(e.value)
    assert msg.startswith(f"http://127.0.0.1:{port}") and "ConnectError" in msg and not msg.endswith(": ")


def _server_inference(url, policy="zero", policy_args=None, codec=None, **server):
    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.inference import ServerInference

    opts = load_config(EvalConfig, None, [f"server.url={url}", "server.protocol=wamkit" if codec is None else
                                          "server.protocol=sglang"] + [f"server.{k}={v}" for k, v in server.items()])
    return ServerInference(policy=policy, policy_args=dict(policy_args or {}), options=opts.server, codec=codec)


def test_the_horizon_asked_for_is_sent_and_held_to(server):
    """horizon= goes to the server as action_horizon; a longer chunk is cut to it, a shorter one refused (a server
    that ignores it must not change how many steps a chunk runs)."""
    from wamkit.eval.inference import PolicyOutputError

    async def run(h):
        inf = _server_inference(server.url, policy_args={"horizon": h})
        await inf.start()
        try:
            return await inf.predict(_obs(2), [0, 1])
        finally:
            await inf.close()

    assert asyncio.run(run(1)).shape == (2, 1, 4)          # the fake answers 2 actions whatever it is asked
    assert server.bodies[-1]["parameters"]["action_horizon"] == 1
    with pytest.raises(PolicyOutputError, match="chunks of 2 actions; horizon=3"):
        asyncio.run(run(3))


def test_server_keys_and_the_policys_own_transport_options_reach_the_client():
    """server.request_timeout_s / retries / retry_s configure the client; cosmos3's own token, timeout_s and
    max_request_size apply where server.* names none (they were silently ignored by the evaluation)."""
    from wamkit.policies import make_policy

    url = "http://127.0.0.1:9"
    c = _server_inference(url, request_timeout_s=7, retries=2, retry_s=30)._make_client(url, None)
    assert (c.timeout_s, c.retries, c.retry_s, c.token) == (7.0, 2, 30.0, None)
    codec = make_policy("cosmos3", token="s3cret", timeout_s=2, max_request_size=1,
                        action_stats={"q01": [-1.0] * 10, "q99": [1.0] * 10}).remote_codec()
    c = _server_inference(url, policy="cosmos3", codec=codec)._make_client(url, None)
    assert (c.token, c.timeout_s, c._max_request) == ("s3cret", 2.0, 1)
    c = _server_inference(url, policy="cosmos3", codec=codec, token="other", request_timeout_s=9)._make_client(url, None)
    assert (c.token, c.timeout_s) == ("other", 9.0)


def test_an_answer_longer_than_the_client_reads_is_refused_once_not_held(server):
    """httpx read a whole answer of any size (or a compressed one of any decoded size) into memory: the client reads
    at most max_answer_mb, counted on the decoded bytes, and a longer answer is one line naming the server, not
    retried (the same request gets the same answer). A compressed answer within the limit still reads as usual."""
    import gzip

    from wamkit.protocol.client import AnswerTooLong

    def answer(n_pad):
        resp = build_response(parse_request(server.bodies[-1]), np.zeros((1, 2, 4), np.float32), "fake", False)
        return json.dumps({**resp, "pad": "x" * n_pad}).encode()

    cap_mb = 4096 / 2 ** 20
    server.script = lambda h, m: (200, {"content-type": "application/json"}, answer(8000)) if m == "POST" else None
    with pytest.raises(AnswerTooLong) as e:
        _predict(server.url, max_answer_mb=cap_mb)
    assert str(e.value).startswith(server.url) and "4096" in str(e.value) and "\n" not in str(e.value)
    assert [m for m, _ in server.seen].count("POST") == 1

    server.seen.clear()
    server.script = lambda h, m: ((200, {"content-type": "application/json", "content-encoding": "gzip"},
                                   gzip.compress(answer(8000))) if m == "POST" else None)
    assert len(gzip.compress(answer(8000))) < 4096   # small on the wire, 8 KB decoded
    with pytest.raises(AnswerTooLong):
        _predict(server.url, max_answer_mb=cap_mb)
    assert [m for m, _ in server.seen].count("POST") == 1

    server.script = lambda h, m: ((200, {"content-type": "application/json", "content-encoding": "gzip"},
                                   gzip.compress(answer(100))) if m == "POST" else None)
    assert _predict(server.url, max_answer_mb=cap_mb).shape == (1, 2, 4)
    assert _predict(server.url).shape == (1, 2, 4)   # the default limit: 256 MB
