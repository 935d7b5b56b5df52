"""The Cosmos3 adapter and `wamkit eval` against SGLang's own action-endpoint code (sglang 0.5.23, the router of
`sglang/multimodal_gen/runtime/entrypoints/action/` with only the model call replaced: tests/sglang_compat/harness.py,
run in the side venv that `make sglang-env` builds). Checked here: request fields and SGLang's defaults we override
(height/width, fps, steps, view point), the image bytes and size the model gets, prompt and SGLang's JSON caption,
seeds, the batch limit read from SGLang's metadata, response decoding, stats on the server vs in the adapter, and
that a request SGLang would refuse is refused by wamkit first (and really refused by SGLang)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies import make_policy
from wamkit.policies.cosmos3 import io as C
from wamkit.protocol.client import ActionClient, ActionClientError
from wamkit.serve.workers import ServerWorker

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
HARNESS = ROOT / "tests" / "sglang_compat" / "harness.py"
pytestmark = pytest.mark.skipif(not SGLANG_PY.exists(), reason="needs the side venv with the sglang wheel: "
                                "`make sglang-env` (make test builds it)")

Q01 = [-0.9, -0.8, -0.7, -1, -1, -1, -1, -1, -1, 0.0]
Q99 = [0.9, 0.8, 0.7, 1, 1, 1, 1, 1, 1, 1.0]


class HarnessWorker(ServerWorker):
    """SGLang's action router with the stand-in model, as a server process."""

    default_start_timeout = 180.0   # importing sglang takes 20-40 s on 2 cores

    def __init__(self, log: Path, stats: Path, batching_max_size: int = 4, server_stats: Path | None = None,
                 inner: str = "fixed-cost", inner_args: dict | None = None):
        super().__init__()
        self.args = ["--batching-max-size", str(batching_max_size), "--standin-stats", str(stats), "--log", str(log),
                     "--inner", inner, "--inner-args", json.dumps(inner_args or {"base_ms": 0, "per_obs_ms": 0})]
        if server_stats is not None:
            self.args += ["--action-stats", str(server_stats)]

    def command(self) -> list[str]:
        return [str(SGLANG_PY), str(HARNESS), "--port", str(self.port), *self.args]


@pytest.fixture(scope="module")
def stats(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("stats") / "stats.json"
    p.write_text(json.dumps({"q01": Q01, "q99": Q99}))
    return p


@pytest.fixture(scope="module")
def sglang(tmp_path_factory, stats):
    """SGLang's router at --batching-max-size 4, no server-side stats."""
    log = tmp_path_factory.mktemp("sglang") / "requests.jsonl"
    with HarnessWorker(log, stats, batching_max_size=4) as w:
        w.request_log = log
        yield w


def _requests(w) -> list[dict]:
    return [json.loads(line) for line in w.request_log.read_text().splitlines()]


def _obs(tasks, seed=0, side=256):
    rng = np.random.default_rng(seed)
    return [Observation(images={c: rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                                for c in ("image", "wrist_image")}, state=None, task=t) for t in tasks]


def test_metadata_and_what_the_model_gets(sglang, stats):
    """SGLang's metadata gives the batch limit; the adapter's requests reach the model with the image bytes, size,
    fps, steps, seed and caption intended (SGLang's defaults 480x832 / fps 5 / 35 steps / seed 42 / ego_view are
    all overridden), and the decoded actions are the model's."""
    n0 = len(_requests(sglang)) if sglang.request_log.exists() else 0
    pol = make_policy("cosmos3", url=sglang.url, action_stats=str(stats))
    tasks = ["open the drawer"] * 5 + ["close it"]
    obs = _obs(tasks)
    a = pol.predict(obs, list(range(6)))
    pol.close()
    ref = make_policy("fixed-cost", base_ms=0, per_obs_ms=0).predict(obs, [1140] * 6)   # the stand-in's inner model
    np.testing.assert_allclose(a, ref, atol=1e-5)
    reqs = _requests(sglang)[n0:]
    assert sorted(r["batch"] for r in reqs) == [1, 1, 4]               # 5 of one prompt split at SGLang's 4
    sent = {hashlib.sha256(C.cosmos3_image(o.images).tobytes()).hexdigest() for o in obs}
    got = {h for r in reqs for h in r["image_sha256"]}
    assert got == sent                                                   # the exact 192x320 pixels, no resampling
    for r in reqs:
        assert (r["height"], r["width"], r["fps"], r["num_inference_steps"]) == (192, 320, 20, 30)
        assert r["seed"] == 1140 and r["num_frames"] == 17 and r["raw_action_dim"] == 10
        assert r["domain_name"] == "libero" and r["view_point"] == "concat_view"
        assert all(s == [192, 320, 3] for s in r["image_shapes"])
        cap = json.loads(r["captions"][0])                               # SGLang's own JSON caption
        assert cap["cinematography"]["framing"].startswith("This video contains concatenated views")
        assert cap["actions"][0]["description"] == r["prompts"][0] + "."
        assert r["prompts"][0] in ("open the drawer", "close it")
        assert cap["resolution"] == {"H": 192, "W": 320}


def test_rlinf_framing_and_per_observation_seeds(sglang, stats):
    n0 = len(_requests(sglang))
    pol = make_policy("cosmos3", url=sglang.url, action_stats=str(stats), framing="rlinf", seed=None)
    obs = _obs(["pick up the mug"] * 3, seed=1)
    a = pol.predict(obs, [7, 8, 7])
    pol.close()
    ref = make_policy("fixed-cost", base_ms=0, per_obs_ms=0).predict(obs, [7, 8, 7])
    np.testing.assert_allclose(a, ref, atol=1e-5)
    reqs = _requests(sglang)[n0:]
    assert sorted((r["seed"], r["batch"]) for r in reqs) == [(7, 2), (8, 1)]
    for r in reqs:
        cap = json.loads(r["captions"][0])
        assert r["view_point"] == "ego_view"
        assert cap["cinematography"]["framing"].startswith("This video is captured from a first-person")
        assert cap["actions"][0]["description"] == "pick up the mug." + C.VIEWS_CAPTION


def test_refused_by_wamkit_first_and_by_sglang_too(sglang):
    """What SGLang answers 400 is refused before sending, with the field; the same body posted raw gets SGLang's 400
    (so the rule is SGLang's, not ours)."""
    from wamkit.protocol import build_sglang_request, encode_body

    obs = [Observation(images={"image": C.cosmos3_image(o.images)}, state=None, task="x") for o in _obs(["x"] * 5)]
    params = C.cosmos3_parameters()

    async def send(o, seeds, max_batch):
        async with ActionClient(sglang.url, mode="sglang", camera="image", parameters=params, raw_action_dim=10,
                                max_request_size=max_batch, retries=0) as c:
            return await c.predict(o, seeds)

    with pytest.raises(ActionClientError, match="batching-max-size=4"):      # the caller forced 5 > 4
        asyncio.run(send(obs, [3] * 5, 5))
    with pytest.raises(ActionClientError, match="parameters.seed"):
        asyncio.run(send(obs[:1], [-1], None))
    for body in (build_sglang_request(obs, 3, params, camera="image", binary=False),
                 build_sglang_request(obs[:1], -1, params, camera="image", binary=False)):
        r = httpx.post(sglang.url + "/v1/actions/generations", content=encode_body(body, False)[0],
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text
    assert asyncio.run(send(obs[:4], [3] * 4, None)).shape == (4, 16, 10)   # within the limit: answered


def test_stats_on_the_server_vs_in_the_adapter(tmp_path, sglang, stats):
    """An SGLang server started with action stats denormalizes itself: normalization=server gives the same env
    actions as the adapter denormalizing answers of a server without stats; mixing them up is refused."""
    obs = _obs(["open the drawer"] * 2, seed=3)
    client_side = make_policy("cosmos3", url=sglang.url, action_stats=str(stats))
    a = client_side.predict(obs, [0, 1])
    client_side.close()
    with HarnessWorker(tmp_path / "log.jsonl", stats, batching_max_size=2, server_stats=stats) as w:
        w.request_log = tmp_path / "log.jsonl"
        server_side = make_policy("cosmos3", url=w.url, normalization="server")
        b = server_side.predict(obs, [0, 1])
        server_side.close()
        assert all(r["server_stats"] for r in _requests(w))
    np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(UserError, match="twice"):
        make_policy("cosmos3", url="http://x", normalization="server", action_stats=str(stats))


@pytest.mark.slow
@pytest.mark.libero
def test_eval_through_sglang_router_matches_wamkit_standin(tmp_path, sglang, stats):
    """`wamkit eval` of cosmos3 on LIBERO, pipelined (auto, 2 envs), through SGLang's router, gives the same
    per-episode results as through `wamkit serve` standing in for SGLang (same inner model and stats)."""
    pytest.importorskip("libero")
    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.runner import run_eval

    base = ["env=libero", "suite=libero_object", "tasks=0", "trials=2", "image_size=64", "max_steps=32",
            "policy=cosmos3", f"policy_args.action_stats={stats}", "inference=server", "mode=auto", "num_envs=2",
            "progress=false", "server.startup_timeout_s=240"]
    via_sglang = run_eval(load_config(EvalConfig, None, base + [f"server.url={sglang.url}",
                                                                f"out={tmp_path / 'sglang'}"]))
    via_standin = run_eval(load_config(EvalConfig, None, base + [
        "server.policy=cosmos3-standin", "server.policy_args.inner=fixed-cost",
        "server.policy_args.inner_args.base_ms=0", "server.policy_args.inner_args.per_obs_ms=0",
        f"out={tmp_path / 'standin'}"]))

    def outcomes(d):
        rows = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines()]
        return sorted((r["key"], r["success"], r["steps"]) for r in rows)

    assert outcomes(tmp_path / "sglang") == outcomes(tmp_path / "standin")
    assert len(outcomes(tmp_path / "sglang")) == 2
    assert via_sglang["scheduler"]["requests"] > 0 and via_standin["scheduler"]["requests"] > 0
