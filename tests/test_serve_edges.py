"""`wamkit serve` at its edges: every number of ServeConfig finite and in range, log_level one of uvicorn's (one line,
exit 2); SIGTERM whose graceful_timeout_s runs out answers the requests still in flight 503 in the JSON error
layout; /healthz and /health tell one health fact (a dead policy child); the IPv6 banner."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import typing

import httpx
import numpy as np
import pytest
from loopback import has_ipv6_loopback
from starlette.testclient import TestClient

from wamkit.cli.main import main
from wamkit.core.config import load_config
from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.protocol import build_request, encode_body
from wamkit.serve import WamkitServerWorker
from wamkit.serve.app import create_app
from wamkit.serve.config import ServeConfig

GEN = "/v1/actions/generations"
HINTS = typing.get_type_hints(ServeConfig)
NUMBERS = sorted(k for k, t in HINTS.items() if t in (int, float))
FLOATS = [k for k in NUMBERS if HINTS[k] is float]


def _one_line_exit_2(capsys, argv: list[str], *words: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and all(w in err for w in words), err


@pytest.mark.parametrize("key", NUMBERS)
def test_every_number_is_refused_below_its_range_naming_the_key(key):
    with pytest.raises(UserError, match=key):
        load_config(ServeConfig, None, [f"{key}=-1"])


@pytest.mark.parametrize("key", FLOATS)
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_every_float_must_be_finite(key, value):
    """inf/nan passed `x > 0`-style checks: max_wait_ms=inf hung every request and made /metrics 500, max_body_mb=inf
    and max_decoded_mb=inf raised OverflowError at start, graceful_timeout_s/log_every_s=nan were taken."""
    with pytest.raises(UserError, match=f"{key} must be a finite number"):
        load_config(ServeConfig, None, [f"{key}={value}"])


@pytest.mark.parametrize("override, words", [
    ("max_wait_ms=inf", ("max_wait_ms", "finite")),
    ("max_body_mb=nan", ("max_body_mb", "finite")),
    ("max_body_mb=1e300", ("max_body_mb", "<=")),
    ("graceful_timeout_s=-1", ("graceful_timeout_s", ">= 0")),
    ("parent_pid=99999999999", ("parent_pid", "<=")),
    ("log_level=nonsense", ("log_level", "'nonsense'", "critical, error, warning, info, debug, trace")),
])
def test_cli_bad_values_are_one_line_and_exit_2(capsys, monkeypatch, override, words):
    import wamkit.serve.app

    def started(*a, **k):
        raise AssertionError("a bad value got past validation: the server started")
    monkeypatch.setattr(wamkit.serve.app, "create_app", started)   # (max_wait_ms=inf would then serve, hung)
    _one_line_exit_2(capsys, ["serve", "policy=zero", "port=0", override], *words)


def test_edges_still_load():
    cfg = load_config(ServeConfig, None, ["port=0", "max_wait_ms=0", "graceful_timeout_s=0", "log_every_s=0",
                                          "max_wait_fraction=1", "log_level=trace", "max_body_mb=0.5"])
    assert cfg.log_level == "trace" and cfg.graceful_timeout_s == 0


def test_graceful_timeout_answers_requests_in_flight_503_json_with_one_log_line():
    """SIGTERM while a 2 s batch computes, graceful_timeout_s=0.3: uvicorn cancels the requests still in flight. They
    used to get a plain-text 500 and a traceback each; now the JSON error body, 503 + Retry-After, and the log holds
    uvicorn's one line. The server still exits by the re-raised SIGTERM."""
    args = {"base_ms": 2000, "per_obs_ms": 0, "action_dim": 3, "horizon": 4}
    w = WamkitServerWorker("fixed-cost", args, max_batch_size=2, max_wait_ms=60000,   # one batch of both
                           extra_args={"graceful_timeout_s": 0.3, "warmup": False})
    obs = [Observation({"image": np.zeros((8, 8, 3), np.uint8)}, None, "t")]
    data, ct = encode_body(build_request(obs, [1], binary=False), False)
    with w:
        async def go():
            async with httpx.AsyncClient(base_url=w.url, timeout=60) as h:
                sent = [asyncio.create_task(h.post(GEN, content=data, headers={"content-type": ct})) for _ in range(2)]
                deadline = time.monotonic() + 60
                while True:    # both observations taken into the (2 s) batch
                    m = (await h.get("/metrics")).json()
                    if m["counts"].get("observations", 0) == 2 and m["queued"] == 0:
                        break
                    assert time.monotonic() < deadline, m
                    await asyncio.sleep(0.05)
                os.killpg(w.pid, signal.SIGTERM)
                return await asyncio.gather(*sent)
        replies = asyncio.run(go())
        assert w.proc.wait(timeout=30) == -signal.SIGTERM
        log = open(w.log_path).read()
    for r in replies:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == 503 and "shutting down" in err["message"] and r.json()["detail"] == err["message"]
    assert "Traceback" not in log and "CancelledError" not in log, log
    after_banner = log.split("wamkit serve: ", 1)[1].strip().splitlines()[1:]
    assert len(after_banner) == 1 and "Cancel 2 running task(s)" in after_banner[0], log    # uvicorn's line


def test_healthz_follows_health_when_the_policy_child_dies_and_its_500s_log_one_line(caplog):
    """/healthz (openpi's) answered 200 OK while /health said 503; and every 500 logged a full traceback."""
    cfg = ServeConfig(policy="fixed-cost", policy_args={"base_ms": 1, "per_obs_ms": 0, "horizon": 4, "action_dim": 3},
                      warmup=False, log_every_s=0, max_wait_ms=1, policy_process=True)
    app = create_app(cfg)
    body = json.dumps(build_request([Observation({"image": np.zeros((8, 8, 3), np.uint8)}, None, "t")], [1],
                                    binary=False))
    with TestClient(app) as c:
        assert c.get("/healthz").text == "OK\n"
        proc = app.state.server.policy._proc
        proc.kill()
        proc.join(10)
        assert c.get("/health").status_code == 503
        hz = c.get("/healthz")
        assert hz.status_code == 503 and hz.text == "policy process exited (exit code -9)\n"
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="wamkit.serve"):
            for _ in range(2):
                assert c.post(GEN, content=body, headers={"content-type": "application/json"}).status_code == 500
    failed = [r for r in caplog.records if "request failed" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info is None and "\n" not in r.getMessage() for r in failed), \
        [r.getMessage() for r in caplog.records]
    assert "policy process exited (exit code -9)" in failed[0].getMessage()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_banner_brackets_the_address():
    p = subprocess.Popen([sys.executable, "-m", "wamkit.cli.main", "serve", "policy=zero", "host=::1", "port=0",
                          "log_every_s=0", "warmup=false"], stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        banner = ""
        while "wamkit serve:" not in banner:
            line = p.stderr.readline()
            assert line, f"no banner; rc={p.poll()}"
            banner = line
        url = banner.split(" on ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://[::1]:"), banner
        deadline = time.monotonic() + 30
        while True:   # the banner's URL is one a client can use
            try:
                assert httpx.get(url + "/health", timeout=2).json()["status"] == "ok"
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)
