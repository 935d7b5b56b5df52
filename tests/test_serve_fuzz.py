"""Seeded fuzz of a real `wamkit serve` (policy `random`) on loopback (issue 16, "done when").

Ten bursts; each sends every hostile case of tests/hostile_requests.py (all of the issue's causes, JSON and msgpack)
plus random mutations of valid bodies, with valid requests mixed in, from 4 concurrent clients: > 2,000 hostile
requests. Asserted: never a 5xx, never a timeout, each hostile case answers its 4xx naming its field, every valid
request (mixed in, and after each burst) gets exactly the actions the policy gives for its seeds, the server never
falls back to its catch-all decode error (metrics decode_unexpected), and its peak RSS after the first burst stays
within a bound far below what one decoded bomb would take."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from hostile_requests import Case, cases, mutate, pack, valid_body
from wamkit.policies import make_policy
from wamkit.protocol import decode_body, parse_response
from wamkit.serve import WamkitServerWorker

POLICY_ARGS = {"action_dim": 7, "horizon": 4}
GEN = "/v1/actions/generations"
BURSTS = 10
MUTATIONS_PER_BURST = 120
VALID_PER_BURST = 20
CLIENTS = 4
RSS_GROWTH_MB = 128   # one 8192 x 8192 PNG decoded would take > 200 MB; nothing near that may stay or peak


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmHWM")


def expected_actions(seeds) -> np.ndarray:
    return make_policy("random", **POLICY_ARGS).predict([None] * len(seeds), list(seeds))


@pytest.fixture(scope="module")
def server():
    extra = {"max_body_mb": 2, "max_decoded_mb": 32, "header_timeout_s": 5, "body_timeout_s": 5, "log_every_s": 0}
    with WamkitServerWorker("random", POLICY_ARGS, max_batch_size=8, max_wait_ms=1, extra_args=extra) as w:
        yield w


def _valid(rng: random.Random, binary: bool) -> tuple[bytes, str, list[int]]:
    n = rng.randint(1, 3)
    body = valid_body(rng.randrange(10 ** 6), binary, n=n)
    data, ct = pack(body, binary)
    return data, ct, body["parameters"]["seed"]


def _check(item, r: httpx.Response) -> str | None:
    """None if the answer is right for the item, else what is wrong."""
    kind, payload = item[0], item[1]
    if r.status_code >= 500:
        return f"{kind} {getattr(payload, 'name', '')}: {r.status_code} {r.text[:200]}"
    if kind == "valid":
        if r.status_code != 200:
            return f"valid request answered {r.status_code}: {r.text[:200]}"
        got = parse_response(decode_body(r.content, r.headers.get("content-type"))).actions
        return None if np.array_equal(got, expected_actions(item[2])) else "valid request got wrong actions"
    if kind == "case":
        case: Case = payload
        if r.status_code not in case.statuses:
            return f"case {case.name}: {r.status_code} not in {case.statuses}: {r.text[:200]}"
        if case.path is not None and r.status_code != 200:
            path = r.json()["error"]["path"]
            if not path.startswith(case.path):
                return f"case {case.name}: error path {path!r} does not name {case.path!r}"
        return None
    if not (r.status_code == 200 or 400 <= r.status_code < 500):   # mutation: answered or refused, nothing else
        return f"mutation: {r.status_code}"
    return None


def _send(client: httpx.Client, item) -> str | None:
    body, ct = (item[1].body, item[1].content_type) if item[0] == "case" else (item[3], item[4])
    try:
        r = client.post(GEN, content=body, headers={"content-type": ct})
    except httpx.TimeoutException as e:
        return f"{item[0]}: timeout ({type(e).__name__})"
    return _check(item, r)


def test_fuzz_no_5xx_no_timeout_valid_answers_exact_rss_bounded(server):
    rng = random.Random(16)
    catalog = cases()
    hostile_sent = 0
    peak_after_first = None
    clients = [httpx.Client(base_url=server.url, timeout=60) for _ in range(CLIENTS)]
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            for burst in range(BURSTS):
                items = [("case", c) for c in catalog]
                for i in range(MUTATIONS_PER_BURST):
                    data, ct = mutate(rng, binary=bool(i % 2))
                    items.append(("mutation", None, None, data, ct))
                for i in range(VALID_PER_BURST):
                    data, ct, seeds = _valid(rng, binary=bool(i % 2))
                    items.append(("valid", None, seeds, data, ct))
                rng.shuffle(items)
                hostile_sent += sum(1 for it in items if it[0] != "valid")
                errors = [e for e in pool.map(lambda a: _send(clients[a[0] % CLIENTS], a[1]), enumerate(items))
                          if e is not None]
                assert not errors, f"burst {burst}: {len(errors)} wrong answers, e.g. {errors[:5]}"
                for binary in (False, True):   # the server still answers valid requests exactly after the burst
                    data, ct, seeds = _valid(rng, binary)
                    assert _send(clients[0], ("valid", None, seeds, data, ct)) is None
                assert server.healthy()
                if burst == 0:
                    peak_after_first = peak_rss_mb(server.pid)
    finally:
        for c in clients:
            c.close()
    assert hostile_sent >= 2000
    counts = httpx.get(server.url + "/metrics").json()["counts"]
    assert counts.get("decode_unexpected", 0) == 0, counts
    grown = peak_rss_mb(server.pid) - peak_after_first
    assert grown < RSS_GROWTH_MB, f"server peak RSS grew by {grown:.0f} MB after the first burst"
