"""Issue 16, server side: each case of the issue reproduced and the new behaviour asserted.

- decode: every hostile body of tests/hostile_requests.py is a 4xx naming its field, in process (fast);
- 1: a foreign server on the eval's port is refused (UserError), never scored;
- 2: a 196 KB PNG declaring 8192 x 8192 is refused on its header, the server's peak RSS does not move;
- 5: slowloris / idle / stalled-body sockets neither exhaust a 256-file limit nor make /health time out;
- 6: a public host without a token is refused; 10 (serve part): a port in use is one line and exit code 2."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from loopback import has_ipv6_loopback

from hostile_requests import cases, mutate, png_bomb, valid_body, pack
from wamkit.core.errors import UserError
from wamkit.protocol import ProtocolError, decode_body, parse_request
from wamkit.protocol.limits import DecodeLimits
from wamkit.serve import ServerIdentityError, WamkitServerWorker
from wamkit.serve.config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
LIMITS = DecodeLimits(max_decoded_bytes=32 * 2 ** 20)   # keep the in-process decoded-bytes case small
GEN = "/v1/actions/generations"
CASES = cases()


def cli(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "wamkit.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def decode(body: bytes, ct: str):
    return parse_request(decode_body(body, ct, LIMITS.max_depth), LIMITS)


def rss_kb(pid: int, key: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


# ------------------------------------------------------------------------------------------ decode, in process
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_body_is_a_4xx_naming_the_field(case):
    if case.statuses == (200,):
        req = decode(case.body, case.content_type)
        assert len(req) == 1
        return
    with pytest.raises(ProtocolError) as e:
        decode(case.body, case.content_type)
    assert e.value.status in case.statuses, str(e.value)
    if case.path is not None:
        assert e.value.path.startswith(case.path), (e.value.path, str(e.value))


def test_random_mutations_raise_only_protocol_errors():
    rng = random.Random(16)
    seen = set()
    for i in range(600):
        body, ct = mutate(rng, binary=bool(i % 2))
        try:
            decode(body, ct)
            seen.add(200)
        except ProtocolError as e:
            assert 400 <= e.status < 500
            seen.add(e.status)
    assert 200 in seen and 400 in seen   # the mutations reach both sides


def test_nonfinite_and_overflowing_state_never_reach_the_policy():
    for state in ([float("nan")] * 8, [1e300] * 8, [float("inf")] + [0.0] * 7):
        body, ct = pack({**valid_body(), "input": {**valid_body()["input"], "state": [state]}}, True)
        with pytest.raises(ProtocolError, match="finite") as e:
            decode(body, ct)
        assert e.value.path.startswith("input.state")
    ok = decode(*pack({**valid_body(), "input": {**valid_body()["input"], "state": [[3e38] * 8]}}, True))
    assert ok.observations[0].state.dtype.name == "float32"


# --------------------------------------------------------------------------------------------- 6: public bind
def test_public_host_needs_a_token_or_allow_insecure(monkeypatch):
    monkeypatch.delenv("WAMKIT_TOKEN", raising=False)
    r = cli("serve", "policy=zero", "host=0.0.0.0", "port=0")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "token" in r.stderr and "allow_insecure" in r.stderr
    from wamkit.core.config import load_config

    for ok in (["token=s3cret"], ["allow_insecure=true"]):
        load_config(ServeConfig, None, ["host=0.0.0.0", *ok])
    monkeypatch.setenv("WAMKIT_TOKEN", "s3cret")
    load_config(ServeConfig, None, ["host=10.1.2.3"])
    for host in ("127.0.0.1", "127.0.0.9", "localhost", "::1"):
        monkeypatch.delenv("WAMKIT_TOKEN")
        load_config(ServeConfig, None, [f"host={host}"])
        monkeypatch.setenv("WAMKIT_TOKEN", "s3cret")


# ------------------------------------------------------------------------------------- 10 (serve): port in use
def test_serve_on_a_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("serve", "policy=zero", f"port={port}")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port={port}" in lines[0] and "in use" in lines[0], r.stderr


# ------------------------------------------------------------------------------------------- 1: server identity
@pytest.fixture(scope="module")
def foreign():
    """A `wamkit serve policy=random` somebody else started (its own instance id, unknown to other workers)."""
    with WamkitServerWorker("random", {"action_dim": 4, "horizon": 2}) as w:
        yield w


def test_worker_refuses_a_healthy_answer_from_another_server(foreign):
    w = WamkitServerWorker("zero", port=foreign.port)
    w.start()
    try:
        with pytest.raises(UserError, match="held by another server|already in use") as e:
            w.wait_healthy(30)
        assert isinstance(e.value, UserError) and str(foreign.port) in str(e.value)
        assert not w.healthy()              # never counted as ours, even while our process lives
    finally:
        w.stop()
    assert foreign.healthy()                 # the foreign server is left alone


def test_health_without_instance_id_is_not_ours(foreign):
    """A server that answers /health without any instance id (e.g. an older wamkit, another program) is refused."""
    w = WamkitServerWorker("zero", port=foreign.port)
    w.instance_id = "not-the-foreign-one"
    w.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with pytest.raises(ServerIdentityError, match=f"port {foreign.port} .* held by another server"):
            w.wait_healthy(10)
    finally:
        w.proc.kill()
        w.proc.wait()


def test_a_free_port_taken_before_the_server_binds_it_is_picked_again():
    w = WamkitServerWorker("zero", {"action_dim": 4, "horizon": 2})      # port=0: picked by the worker
    taken = w.port
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()                           # somebody else got there first
        with w:
            assert w.port != taken and w.healthy() and w.starts == 2


def test_a_long_log_tail_says_what_was_cut_and_where_the_whole_log_is(tmp_path):
    """The cut line named the log file; a Ray server actor removes that file right after (its line named a file
    gone): the caller says what to name instead."""
    w = WamkitServerWorker("zero", log_path=tmp_path / "server.log")
    w.log_path.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert w.log_tail(3) == "line 997\nline 998\nline 999"
    head, rest = w.log_tail(None, max_bytes=100).split("\n", 1)
    assert head == f"[... {w.log_path.stat().st_size - 100} bytes cut; {w.log_path}]" and rest.endswith("line 999\n")
    head = w.log_tail(None, max_bytes=100, whole_log="the whole log was not kept").split("\n", 1)[0]
    assert head.endswith("bytes cut; the whole log was not kept]") and str(w.log_path) not in head


@pytest.mark.skipif(not has_ipv6_loopback(), reason="needs an IPv6 loopback (::1)")
def test_a_server_worker_on_the_ipv6_loopback_picks_its_port_and_serves():
    """server.host=::1 with port 0: free_port bound an AF_INET socket to '::1' (a gaierror before the server ran)."""
    w = WamkitServerWorker("zero", {"action_dim": 4, "horizon": 2}, host="::1")
    with w:
        assert w.port > 0 and w.healthy()


@pytest.mark.slow
@pytest.mark.metaworld
def test_eval_against_a_foreign_server_on_its_port_fails_and_scores_nothing(foreign, tmp_path):
    """The issue's scenario: `wamkit serve policy=random port=P`, then `wamkit eval policy=metaworld-expert
    inference=server server.port=P` used to score the foreign server and exit 0."""
    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.runner import run_eval

    cfg = load_config(EvalConfig, None, ["env=metaworld", "suite=mt", "env_args.tasks=reach-v3", "trials=1",
                                         "image_size=32", "policy=metaworld-expert", "horizon=4", "max_steps=8",
                                         "progress=false", "inference=server", f"server.port={foreign.port}",
                                         f"out={tmp_path / 'out'}"])
    with pytest.raises(UserError, match="held by another server|already in use"):
        run_eval(cfg)
    assert not (tmp_path / "out" / "summary.json").exists()
    assert foreign.healthy()


# ----------------------------------------------------------------------------------------- 2: decompression DoS
def test_png_declaring_8192x8192_is_refused_before_decoding_and_rss_stays_flat():
    bomb = png_bomb(8192, 8192)
    assert len(bomb) < 256 * 1024            # the 196 KB file: small on the wire, 201 MB decoded
    import base64
    import json

    body = json.dumps({"input": {"task": "t", "image": {"b64_json": base64.b64encode(bomb).decode()}}}).encode()
    with WamkitServerWorker("zero", {"action_dim": 4, "horizon": 2}) as w, httpx.Client(base_url=w.url) as c:
        ok = c.post(GEN, content=pack(valid_body(), True)[0], headers={"content-type": "application/msgpack"})
        assert ok.status_code == 200
        peak0 = rss_kb(w.pid)
        for _ in range(5):
            r = c.post(GEN, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["path"] == "input.image.b64_json", r.text
            assert "8192x8192" in r.json()["error"]["message"]
        grown_mb = (rss_kb(w.pid) - peak0) / 1024
        assert grown_mb < 64, f"peak RSS grew by {grown_mb:.0f} MB (decoding would take > 200 MB)"
        assert c.post(GEN, content=pack(valid_body(), True)[0],
                      headers={"content-type": "application/msgpack"}).status_code == 200


# ------------------------------------------------------------------------------------------- 5: slow clients
def _low_fd_python(tmp_path: Path, n: int) -> str:
    """A python that runs with a file limit of n (soft and hard), as in the issue's 256-file reproduction."""
    p = tmp_path / "python-lowfd"
    p.write_text(f"#!/bin/sh\nulimit -n {n} && exec {sys.executable} \"$@\"\n")
    p.chmod(0o755)
    return str(p)


def test_slowloris_idle_and_stalled_body_sockets_do_not_block_health(tmp_path):
    extra = {"header_timeout_s": 2, "body_timeout_s": 2, "keep_alive_timeout_s": 1}
    w = WamkitServerWorker("zero", {"action_dim": 4, "horizon": 2}, python=_low_fd_python(tmp_path, 256),
                           extra_args=extra)
    socks: list[socket.socket] = []
    with w:
        try:
            for i in range(300):                  # more sockets than the server has files
                s = socket.create_connection(("127.0.0.1", w.port), timeout=10)
                if i % 3 == 0:
                    s.sendall(b"POST /v1/actions/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")   # never ends
                elif i % 3 == 1:
                    s.sendall(b"POST /v1/actions/generations HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: "
                              b"application/msgpack\r\ncontent-length: 100000\r\n\r\n" + b"\x80" * 10)  # stalls
                socks.append(s)                   # i % 3 == 2: idle, sends nothing
                if i % 50 == 49:
                    r = httpx.get(w.url + "/health", timeout=10)
                    assert r.status_code == 200 and r.json()["instance_id"] == w.instance_id
            # every one of them is eventually closed by the server (header deadline, connection cap, or 408 + close)
            answers = {}
            for s in socks:
                s.settimeout(30)
                data = b""
                try:
                    while chunk := s.recv(65536):
                        data += chunk
                except ConnectionResetError:
                    pass
                answers[data.split(b"\r\n", 1)[0]] = answers.get(data.split(b"\r\n", 1)[0], 0) + 1
            assert set(answers) <= {b"", b"HTTP/1.1 408 Request Timeout"}, answers
            m = httpx.get(w.url + "/metrics").json()["counts"]
            assert m.get("closed_connection_cap", 0) > 0 and m.get("closed_header_timeout", 0) > 0, m
            assert httpx.get(w.url + "/health", timeout=10).status_code == 200
            log = w.log_path.read_text(errors="replace")
            assert "Too many open files" not in log and "clamped to" in log   # accept() never ran out of files
            with httpx.Client(base_url=w.url) as c:
                r = c.post(GEN, content=pack(valid_body(), True)[0], headers={"content-type": "application/msgpack"})
                assert r.status_code == 200
        finally:
            for s in socks:
                s.close()


def test_stalled_body_gets_408_idle_keep_alive_is_closed_and_big_headers_refused():
    with WamkitServerWorker("zero", {"action_dim": 4, "horizon": 2},
                            extra_args={"body_timeout_s": 1, "keep_alive_timeout_s": 1, "header_timeout_s": 30}) as w:
        with socket.create_connection(("127.0.0.1", w.port), timeout=30) as s:
            s.sendall(b"POST /v1/actions/generations HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{\"input\":")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in data
        with socket.create_connection(("127.0.0.1", w.port), timeout=30) as s:   # keep-alive, then idle
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 200")   # recv returned b"": the server closed the idle connection
        assert httpx.get(w.url + "/metrics").json()["counts"].get("body_timeouts") == 1
        with socket.create_connection(("127.0.0.1", w.port), timeout=30) as s:   # headers growing past 16 KB
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 17 * 1024)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 400")
        assert httpx.get(w.url + "/health").status_code == 200
