"""Security probe of `wamkit serve` (session 33): each finding reproduced against a real server on loopback (or the
codec in process) and the new behaviour asserted.

- D1 container amplification: bodies/frames of millions of empty maps or lists are a 413 naming max_containers,
  counted before the tree is built; nested pixel lists of several 224x224 images still pass; websockets take no
  permessage-deflate (a few KB of it inflated to a whole frame);
- D3 browsers: a websocket Origin not in allowed_origins is a 403, a Host header that is not a loopback name a 400
  (allowed_hosts adds names), a content type other than JSON or msgpack (text/plain;charset=msgpack, none) a 415;
  metadata's model_path is never absolute;
- D4 one budget of decoded image bytes over every request held (max_inflight_decoded_mb): 503 + Retry-After past it,
  given back on every path;
- M1 at the connection cap a body arriving a byte at a time is dropped (408) before /health is;
- M4 credential header values never reach the server's log (trace level);
- M5 a 500 carries no absolute path, a bad image's 400 no object repr, unknown routes answer 401 without the token;
- M8 an idle websocket is closed with 1000 after ws_idle_timeout_s; token_file.

No timing thresholds: requests are held in the queue by a long max_wait_ms and released by the request that fills
the batch, the slow bodies prove they are past their headers by the server's 100 Continue."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosedOK, InvalidStatus
from websockets.sync.client import connect

from hostile_requests import pack, valid_body
from wamkit.core.errors import ConfigError
from wamkit.policies.simple import ZeroPolicy
from wamkit.protocol import ProtocolError, decode_body
from wamkit.protocol.openpi import packb, unpackb
from wamkit.serve import WamkitServerWorker
from wamkit.serve.config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
GEN = "/v1/actions/generations"
REALTIME = "/v1/actions/realtime"
ZERO = {"action_dim": 4, "horizon": 2}
TOKEN = "s33-s3cret-token"
MP, JS = "application/msgpack", "application/json"


def empty_maps(n: int, json_body: bool = False) -> bytes:
    """The probe's body: {"input": {"task": "t", "state": [{}, {}, ... n of them]}}."""
    if json_body:
        return b'{"input":{"task":"t","state":[' + b",".join([b"{}"] * n) + b"]}}"
    return b"\x81\xa5input\x82\xa4task\xa1t\xa5state" + b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n


def raw_image(side: int, seed: int = 0) -> dict:
    img = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return {"dtype": "uint8", "shape": [side, side, 3], "bytes": img.tobytes()}


def request(sides: list[int], seed: int = 0) -> bytes:
    """A msgpack request of one observation per image side (raw uint8 images: side * side * 3 decoded bytes each)."""
    return msgpack.packb({"input": {"task": "t", "image": [raw_image(s, seed + i) for i, s in enumerate(sides)]},
                          "parameters": {"seed": [seed + i for i in range(len(sides))]}}, use_bin_type=True)


def ok_request(c: httpx.Client) -> int:
    return c.post(GEN, content=pack(valid_body(), True)[0], headers={"content-type": MP}).status_code


def metrics(url: str) -> dict:
    return httpx.get(url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()


def wait_for(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def srv():
    """Defaults (no token, loopback): the limits as shipped."""
    with WamkitServerWorker("zero", ZERO) as w:
        yield w


@pytest.fixture(scope="module")
def tok_srv():
    """A token, the trace log, an idle websocket timeout of 1 s, one allowed origin and one extra host name."""
    with WamkitServerWorker("zero", ZERO, token=TOKEN,
                            extra_args={"log_level": "trace", "ws_idle_timeout_s": 1, "log_every_s": 0,
                                        "allowed_origins": "http://ok.example", "allowed_hosts": "wamkit.test"}) as w:
        yield w


# ------------------------------------------------------------------------------------ D1: container amplification
@pytest.mark.parametrize("json_body", [False, True], ids=["msgpack", "json"])
def test_more_containers_than_max_containers_is_a_413_before_the_tree_is_built(json_body):
    ct = JS if json_body else MP
    # 2 maps + 1 list + n empty maps: at the limit it decodes, one past it is refused
    assert decode_body(empty_maps(7, json_body), ct, max_containers=10)["input"]["state"] == [{}] * 7
    with pytest.raises(ProtocolError) as e:
        decode_body(empty_maps(8, json_body), ct, max_containers=10)
    assert e.value.status == 413 and "max_containers" in str(e.value) and e.value.path == ""


def test_json_brackets_inside_strings_are_not_containers():
    body = json.dumps({"input": {"task": "[{" * 500 + '\\"[' * 100, "x": []}}).encode()
    assert decode_body(body, JS, max_containers=3)["input"]["x"] == []
    with pytest.raises(ProtocolError, match="max_containers"):
        decode_body(body, JS, max_containers=2)
    with pytest.raises(ProtocolError, match="not valid JSON"):   # a string cut off at the end: scanned once, refused
        decode_body(b'{"a": "' + b'\\"[' * 200000, JS, max_containers=10)


def test_the_probes_empty_container_bodies_and_frames_are_413_and_the_server_keeps_serving(srv):
    """4 MB of empty maps/lists (2**22 containers, default max_containers 2**20) cost the server 0.35-1 GB and 15 s
    of CPU before a 400; now a 413 naming the limit. The websocket frame goes through the same decoder."""
    n = 4 << 20
    bodies = [(empty_maps(n), MP), (empty_maps(n, json_body=True), JS),
              (b"\x81\xa5input\x82\xa4task\xa1t\xa5state\xdd" + n.to_bytes(4, "big") + b"\x90" * n, MP)]
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        for body, ct in bodies:
            r = c.post(GEN, content=body, headers={"content-type": ct})
            assert r.status_code == 413, r.text[:200]
            assert "max_containers" in r.json()["error"]["message"] and r.json()["error"]["code"] == 413
            assert ok_request(c) == 200
    with connect(f"ws://{srv.host}:{srv.port}{REALTIME}", max_size=None) as ws:
        unpackb(ws.recv())
        ws.send(empty_maps(n))
        err = unpackb(ws.recv(timeout=120))["error"]
        assert err["code"] == 413 and "max_containers" in err["message"]
        ws.send(packb(valid_body()))                          # the same connection keeps serving
        assert unpackb(ws.recv(timeout=60))["data"][0]["action"]["shape"] == [2, 4]


def test_websockets_take_no_permessage_deflate(srv):
    """With it, a few KB on the wire inflated to a max_body_mb frame of empty maps."""
    with connect(f"ws://{srv.host}:{srv.port}{REALTIME}", compression="deflate", max_size=None) as ws:
        unpackb(ws.recv())
        assert ws.protocol.extensions == []                   # offered by the client, declined by the server


def test_several_224px_images_as_nested_pixel_lists_are_still_served(srv):
    """A 224x224x3 image as nested lists is 50,400 lists: five of them fit max_containers with room to spare."""
    imgs = [np.random.default_rng(i).integers(0, 256, (224, 224, 3), dtype=np.uint8).tolist() for i in range(5)]
    body = json.dumps({"input": {"task": "t", "image": imgs}, "parameters": {"seed": [0, 1, 2, 3, 4]}}).encode()
    r = httpx.post(srv.url + GEN, content=body, headers={"content-type": JS}, timeout=120)
    assert r.status_code == 200 and len(r.json()["data"]) == 5, r.text[:300]


# ---------------------------------------------------------------------------------------------- D3: browsers
def test_content_type_is_matched_exactly(srv):
    """text/plain (any charset) and a missing type are what a page may send to any origin without a preflight: 415,
    naming the header. msgpack's spellings and JSON with parameters are served."""
    mp_body, js_body = pack(valid_body(), True)[0], pack(valid_body(binary=False), False)[0]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for body, ct in [(mp_body, "text/plain;charset=msgpack"), (js_body, "text/plain"), (js_body, None),
                         (js_body, "application/json-seq"), (mp_body, "application/msgpack-evil")]:
            r = c.post(GEN, content=body, headers={"content-type": ct} if ct else {})
            assert r.status_code == 415 and "content-type" in r.json()["error"]["message"], (ct, r.text)
        for body, ct in [(mp_body, MP), (mp_body, "application/x-msgpack"), (mp_body, "application/vnd.msgpack"),
                         (js_body, "Application/JSON; charset=utf-8")]:
            assert c.post(GEN, content=body, headers={"content-type": ct}).status_code == 200, ct


def _handshake(port: int, host: str, path: str = "/") -> bytes:
    """The status line a raw websocket handshake with this Host header gets."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        return s.recv(65536).split(b"\r\n", 1)[0]


def test_host_header_must_name_the_loopback_when_bound_to_it(srv, tok_srv):
    """DNS rebinding: a page at http://evil.example:PORT whose name now resolves to 127.0.0.1 sends Host:
    evil.example:PORT."""
    port = srv.port
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", ""):
            r = c.get("/v1/actions/metadata", headers={"host": host})
            assert r.status_code == 400 and "Host header" in r.json()["error"]["message"], (host, r.text)
        r = c.post(GEN, content=pack(valid_body(), True)[0], headers={"content-type": MP, "host": "evil.example"})
        assert r.status_code == 400
        for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", f"127.0.0.2:{port}", f"[::1]:{port}"):
            assert c.get("/v1/actions/metadata", headers={"host": host}).status_code == 200, host
    assert _handshake(port, f"evil.example:{port}") == b"HTTP/1.1 400 Bad Request"
    assert _handshake(port, f"127.0.0.1:{port}") == b"HTTP/1.1 101 Switching Protocols"
    r = httpx.get(tok_srv.url + "/health", headers={"host": f"wamkit.test:{tok_srv.port}"})   # allowed_hosts
    assert r.status_code == 200


def test_websocket_origin_is_refused_unless_allowed(srv, tok_srv):
    with pytest.raises(InvalidStatus) as e:
        connect(f"ws://{srv.host}:{srv.port}/", origin="http://evil.example")
    assert e.value.response.status_code == 403 and b"allowed_origins" in e.value.response.body
    with connect(f"ws://{srv.host}:{srv.port}/", max_size=None) as ws:    # no Origin: openpi's client, websockets
        assert unpackb(ws.recv())["server"]["name"] == "wamkit"
    # the same origin as the Host (websocket-client sends that by default; a review's finding: it got 403)
    with connect(f"ws://{srv.host}:{srv.port}/", origin=f"http://{srv.host}:{srv.port}", max_size=None) as ws:
        assert unpackb(ws.recv())["server"]["name"] == "wamkit"
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    with connect(f"ws://{tok_srv.host}:{tok_srv.port}/", origin="http://ok.example", additional_headers=hdr) as ws:
        assert unpackb(ws.recv())["server"]["name"] == "wamkit"
    with pytest.raises(InvalidStatus) as e:
        connect(f"ws://{tok_srv.host}:{tok_srv.port}/", origin="http://ok.example.evil", additional_headers=hdr)
    assert e.value.response.status_code == 403


def test_metadata_model_path_is_never_absolute(tmp_path, monkeypatch):
    from wamkit.policies.manifest import EXPORT_MARKER
    from wamkit.serve.metadata import model_path

    export = tmp_path / "runs" / "export" / "wam-ref-libero"
    export.mkdir(parents=True)
    (export / EXPORT_MARKER).write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert model_path(str(export)) == "runs/export/wam-ref-libero"        # below the server's directory: as given
    monkeypatch.chdir(tmp_path / "runs" / "export" / "wam-ref-libero")
    assert model_path(str(export)) == "wam-ref-libero"
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    assert model_path(str(export)) == "wam-ref-libero"                    # elsewhere: its own name
    assert model_path("zero") is None


# ----------------------------------------------------------------------------- D4: decoded bytes of all requests
def test_decoded_images_of_all_requests_held_share_one_budget_given_back_on_every_path():
    """max_decoded_mb=1 per request and max_inflight_decoded_mb=1 for all: request A (one 256x256 image, 196,608
    bytes) waits in the queue for a second observation (max_batch_size 2, max_wait_ms 60 s). B (two 400x400 images,
    960,000 bytes) fits a request but not next to A: 503 + Retry-After, over HTTP and the websocket. A failing
    request gives its bytes back; C completes A's batch; then B's size is served."""
    w = WamkitServerWorker("zero", ZERO, max_batch_size=2, max_wait_ms=60000,
                           extra_args={"max_decoded_mb": 1, "max_inflight_decoded_mb": 1, "log_every_s": 0})
    with w:
        held = lambda: metrics(w.url)["inflight_decoded_bytes"]   # noqa: E731
        big = request([400, 400], seed=10)

        async def go():
            async with httpx.AsyncClient(base_url=w.url, timeout=120) as h:
                post = lambda body: h.post(GEN, content=body, headers={"content-type": MP})   # noqa: E731
                a = asyncio.create_task(post(request([256], seed=1)))
                await asyncio.to_thread(wait_for, lambda: metrics(w.url)["queued"] == 1, "A queued")
                assert held() == 256 * 256 * 3
                b = await post(big)
                assert b.status_code == 503 and int(b.headers["retry-after"]) >= 1, b.text
                assert "max_inflight_decoded_mb" in b.json()["error"]["message"]
                with connect(f"ws://{w.host}:{w.port}{REALTIME}", max_size=None) as ws:
                    unpackb(ws.recv())
                    ws.send(big)
                    err = unpackb(ws.recv(timeout=60))["error"]
                    assert err["code"] == 503 and err["retry_after_s"] > 0
                bad = msgpack.unpackb(request([256, 256], seed=20))
                bad["input"]["image"][1]["bytes"] = bad["input"]["image"][1]["bytes"][:-1]   # decoded after the 1st
                r = await post(msgpack.packb(bad, use_bin_type=True))
                assert r.status_code == 400 and r.json()["error"]["path"] == "input.image[1].bytes", r.text
                assert held() == 256 * 256 * 3                       # only A's bytes: the failed ones came back
                c = await post(request([256], seed=2))               # fills A's batch: both are answered
                assert c.status_code == 200 and (await a).status_code == 200
                assert held() == 0
                d = await post(big)
                assert d.status_code == 200, d.text
        asyncio.run(go())
        assert held() == 0


# --------------------------------------------------------------------------------------- M1: slow-body flood
def test_bodies_sent_a_byte_at_a_time_do_not_lock_out_health_at_the_connection_cap():
    """max_connections=8, eight requests past their headers (the server's 100 Continue says so) sending one body
    byte: /health used to be dropped (the cap only evicted sockets still waiting for headers) until body_timeout_s."""
    w = WamkitServerWorker("zero", ZERO, extra_args={"max_connections": 8, "header_timeout_s": 600,
                                                     "body_timeout_s": 600, "min_body_kb_per_s": 1000000})
    socks: list[socket.socket] = []
    with w:
        try:
            for _ in range(8):
                s = socket.create_connection(("127.0.0.1", w.port), timeout=60)
                s.sendall(b"POST /v1/actions/generations HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: "
                          b"application/json\r\ncontent-length: 100000\r\nexpect: 100-continue\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 100")    # the app is reading this body
                s.sendall(b"{")
                socks.append(s)
            r = httpx.get(w.url + "/health", timeout=60)
            assert r.status_code == 200 and r.json()["instance_id"] == w.instance_id
            answers = []
            for s in socks:
                s.settimeout(0.5)
                try:
                    answers.append(s.recv(65536).split(b"\r\n", 1)[0])
                except (TimeoutError, socket.timeout):
                    pass                                           # still sending its body: not dropped
            assert b"HTTP/1.1 408 Request Timeout" in answers, answers
            assert metrics(w.url)["counts"]["closed_connection_cap"] >= 1
        finally:
            for s in socks:
                s.close()


# ---------------------------------------------------------------------------------------------- M4: logs
def test_credential_headers_never_reach_the_log(tok_srv):
    """At log_level=trace uvicorn logged each request's ASGI scope and websockets each handshake header, the token
    with them."""
    with connect(f"ws://{tok_srv.host}:{tok_srv.port}{REALTIME}", additional_headers={"Authorization":
                                                                                      f"Bearer {TOKEN}"}) as ws:
        unpackb(ws.recv())
    assert httpx.get(tok_srv.url + "/metrics", headers={"authorization": f"Api-Key {TOKEN}"}).status_code == 200
    log = tok_srv.log_path.read_text(errors="replace")
    assert "[redacted]" in log and "authorization" in log.lower()     # the headers are logged, their values not
    assert TOKEN not in log


def test_redaction_covers_both_log_forms():
    import logging

    from wamkit.serve.http import RedactSecrets

    for msg, args in [("< %s: %s", ("authorization", "Bearer abc")), ("scope=%s", ({"headers": [
            (b"host", b"x"), (b"authorization", b"Api-Key abc"), (b"x-api-key", b"abc")]},)),
            ("Api-Key: abc", None)]:
        rec = logging.LogRecord("uvicorn.error", logging.DEBUG, "", 0, msg, args, None)
        assert RedactSecrets().filter(rec) and "abc" not in rec.getMessage() and "[redacted]" in rec.getMessage()


# ------------------------------------------------------------------------------------------ M5: error replies
class _LeakyPolicy(ZeroPolicy):
    """Fails as a policy loading weights from the server's disk would."""

    def predict(self, observations, seeds):
        raise FileNotFoundError(2, "No such file or directory", "/srv/secret/models/run-7/weights.pt")


def test_a_500_tells_the_exception_without_absolute_paths_over_http_and_websocket():
    from starlette.testclient import TestClient

    from wamkit.serve.app import create_app

    app = create_app(ServeConfig(policy="zero", warmup=False, log_every_s=0), _LeakyPolicy(**ZERO))
    with TestClient(app) as c:
        r = c.post(GEN, content=pack(valid_body(), True)[0], headers={"content-type": MP})
        with c.websocket_connect(REALTIME) as ws:
            ws.receive_bytes()
            ws.send_bytes(packb(valid_body()))
            ws_err = unpackb(ws.receive_bytes())["error"]
    for err in (r.json()["error"], ws_err):
        assert err["code"] == 500 and err["message"].startswith("FileNotFoundError:"), err
        assert "weights.pt" in err["message"] and "/srv/secret" not in err["message"]


def test_a_bad_image_names_the_field_and_the_problem_not_an_object(srv):
    png_magic = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
    body = json.dumps({"input": {"task": "t", "image": {"b64_json": png_magic}}}).encode()
    r = httpx.post(srv.url + GEN, content=body, headers={"content-type": JS}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["path"] == "input.image.b64_json", r.text
    assert "PNG/JPEG" in err["message"] and "object at 0x" not in err["message"] and "BytesIO" not in err["message"]


def test_unknown_routes_and_methods_need_the_token(tok_srv):
    auth = {"authorization": f"Bearer {TOKEN}"}
    for method, path, status in [("GET", "/v1/nope", 404), ("GET", GEN, 405), ("POST", "/health", 405),
                                 ("GET", "/admin", 404)]:
        r = httpx.request(method, tok_srv.url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
        assert httpx.request(method, tok_srv.url + path, headers=auth).status_code == status
    assert httpx.get(tok_srv.url + "/health").status_code == 200           # /health needs none


# ------------------------------------------------------------------------------------- M8: idle websockets
def test_an_idle_websocket_is_closed_normally(tok_srv):
    with connect(f"ws://{tok_srv.host}:{tok_srv.port}/", additional_headers={"Authorization": f"Bearer {TOKEN}"},
                 max_size=None) as ws:
        unpackb(ws.recv())
        with pytest.raises(ConnectionClosedOK) as e:     # it answers pings, yet sends no frame for 1 s
            ws.recv(timeout=60)
    assert e.value.rcvd.code == 1000 and "ws_idle_timeout_s" in e.value.rcvd.reason


# ------------------------------------------------------------------------------------------------ token_file
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "wamkit.cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "WAMKIT_TOKEN"})


def test_token_file(tmp_path, monkeypatch, caplog):
    from wamkit.core.config import load_config

    monkeypatch.delenv("WAMKIT_TOKEN", raising=False)
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    with caplog.at_level("WARNING", logger="wamkit.serve"):
        cfg = load_config(ServeConfig, None, [f"token_file={f}", "host=0.0.0.0"])   # a public bind: token set
    assert cfg.resolved_token() == TOKEN and not caplog.records
    f.chmod(0o644)
    with caplog.at_level("WARNING", logger="wamkit.serve"):
        load_config(ServeConfig, None, [f"token_file={f}"])
    assert any("chmod 600" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="not both"):
        load_config(ServeConfig, None, [f"token_file={f}", "token=x"])
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, words in [(tmp_path / "missing", "cannot read"), (empty, "empty")]:
        r = _cli("serve", "policy=zero", "port=0", f"token_file={path}")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"token_file={path}" in r.stderr and words in r.stderr


def test_a_server_started_with_token_file_requires_that_token(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN)
    f.chmod(0o600)
    with WamkitServerWorker("zero", ZERO, extra_args={"token_file": str(f), "log_every_s": 0}) as w:
        assert httpx.get(w.url + "/v1/actions/metadata").status_code == 401
        md = httpx.get(w.url + "/v1/actions/metadata", headers={"authorization": f"Bearer {TOKEN}"})
        assert md.status_code == 200 and md.json()["server"]["auth"] is True


def test_the_client_reads_a_json_answer_whatever_its_content_type():
    """A review's finding: the exact content-type match (for requests: what a browser may send) was applied to the
    answers wamkit's client reads too, so a server or proxy answering JSON as text/json, octet-stream or with no
    type failed. The client reads any type but msgpack's as JSON; a request without one is still a 415."""
    from wamkit.protocol.codec import decode_body
    from wamkit.protocol.errors import ProtocolError

    body = b'{"id": "x", "data": []}'
    for ct in (None, "", "text/json", "application/octet-stream", "text/plain; charset=utf-8"):
        assert decode_body(body, ct, lenient=True) == {"id": "x", "data": []}
        with pytest.raises(ProtocolError) as e:
            decode_body(body, ct)
        assert e.value.status == 415


def test_the_websocket_client_reads_no_frame_over_its_cap(monkeypatch):
    """A probe's finding: wamkit's websocket client read frames of any size (max_size=None), so a server.url that
    answers with a huge frame made the evaluating process buffer all of it. Frames over MAX_FRAME_BYTES close the
    connection (1009) instead (here with the cap lowered to 1 MiB, against a server whose metadata frame is 2 MiB)."""
    import asyncio

    from websockets.asyncio.server import serve
    from websockets.exceptions import ConnectionClosedError

    import wamkit.serve.ws_pool as ws_pool

    monkeypatch.setattr(ws_pool, "MAX_FRAME_BYTES", 1 << 20)

    async def huge(ws):
        await ws.send(b"\x00" * (2 << 20))
        await asyncio.sleep(1)

    async def main():
        async with serve(huge, "127.0.0.1", 0, max_size=None) as server:
            port = server.sockets[0].getsockname()[1]
            pool = ws_pool.ConnectionPool(f"ws://127.0.0.1:{port}", {}, 1, 5.0, 5.0)
            with pytest.raises(ConnectionClosedError) as e:
                await pool.connect()
            return e.value.rcvd or e.value.sent

    frame = asyncio.run(main())
    assert frame is not None and frame.code == 1009
