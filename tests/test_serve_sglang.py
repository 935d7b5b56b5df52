"""The SGLang path: the worker's command line, the request/response codec against payloads shaped like SGLang's
protocol (msgpack array markers with bytes keys, padded action channels, shuffled data), the client's sglang mode
end to end (against a wamkit server, which accepts SGLang's request form), and a real-SGLang integration test that
runs only with `sglang` importable and a CUDA GPU."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import msgpack
import numpy as np
import pytest

from wamkit.core.types import Observation
from wamkit.policies import make_policy
from wamkit.protocol import (build_sglang_request, decode_body, decode_sglang_response, encode_body, parse_request,
                             sglang_parameters)
from wamkit.serve import ActionClient, SGLangServerWorker, WamkitServerWorker


def obs(n, side=12, tasks=None):
    rng = np.random.default_rng(1)
    return [Observation({"image": rng.integers(0, 256, (side, side, 3), dtype=np.uint8),
                         "wrist_image": rng.integers(0, 256, (side, side, 3), dtype=np.uint8)}, None,
                        (tasks or ["open the drawer"])[i % len(tasks or [1])]) for i in range(n)]


def test_sglang_worker_command_line():
    w = SGLangServerWorker("/models/cosmos3-libero", port=30123, batching_max_size=16, batching_delay_ms=5,
                           extra_args=["--num-gpus", "1"])
    assert w.command() == ["sglang", "serve", "--model-path", "/models/cosmos3-libero", "--model-type", "diffusion",
                           "--host", "127.0.0.1", "--port", "30123", "--attention-backend", "fa",
                           "--batching-mode", "dynamic", "--batching-max-size", "16", "--batching-delay-ms", "5",
                           "--num-gpus", "1"]
    assert w.url == "http://127.0.0.1:30123" and w.health_path == "/health" and not w.running()
    w2 = SGLangServerWorker("m")
    assert w2.port > 0 and "--port" in w2.command()  # port=0 picked a free port


def test_sglang_parameters_rules():
    p = sglang_parameters(raw_action_dim=7, domain_name="libero", action_horizon=16, num_inference_steps=10)
    assert p["num_frames"] == 17 and p["action_mode"] == "policy" and p["raw_action_dim"] == 7
    with pytest.raises(ValueError, match="multiple of 4"):
        sglang_parameters(domain_name="libero", action_horizon=10)
    with pytest.raises(ValueError, match="num_frames"):
        sglang_parameters(domain_name="libero", action_horizon=16, num_frames=16)
    with pytest.raises(ValueError, match="domain_name or domain_id"):
        sglang_parameters(raw_action_dim=7)
    with pytest.raises(ValueError, match="raw_action_dim"):
        sglang_parameters(domain_id=5)


def test_build_sglang_request_shapes():
    p = sglang_parameters(raw_action_dim=7, domain_name="libero")
    one = build_sglang_request(obs(1), 42, p)
    assert isinstance(one["input"]["image"], dict) and one["input"]["prompt"] == "open the drawer"
    assert one["parameters"]["seed"] == 42 and one["runtime"]["output_format"] == "numpy"
    im = one["input"]["image"]
    assert im["__ndarray__"] is True and im["shape"] == [12, 12, 3] and len(im["data"]) == 12 * 12 * 3
    three = build_sglang_request(obs(3), 1, p, camera="wrist_image")
    assert len(three["input"]["image"]) == 3
    mixed = build_sglang_request(obs(2, tasks=["a", "bb"]), 1, p)
    assert mixed["input"]["prompt"] == ["a", "bb"]
    js = build_sglang_request(obs(2), 1, p, binary=False)
    assert all("b64_json" in x for x in js["input"]["image"]) and js["runtime"]["output_format"] == "list"
    with pytest.raises(ValueError, match="batching-max-size"):
        build_sglang_request(obs(3), 1, p, max_batch_size=2)
    # the msgpack body SGLang would unpack: its object hook sees the marker; a wamkit server accepts it too
    data, ct = encode_body(three, True)
    req = parse_request(decode_body(data, ct))
    assert len(req) == 3 and np.array_equal(req.observations[2].images["image"], obs(3)[2].images["wrist_image"])


def _sglang_style_response(actions: np.ndarray, raw_action_dim: int, order) -> bytes:
    """An envelope packed the way SGLang's server packs msgpack responses (numpy values -> array marker, bytes keys)."""
    def marker(a):
        return {b"__ndarray__": True, b"data": a.tobytes(), b"dtype": a.dtype.str, b"shape": a.shape}
    body = {"id": "act_1", "object": "action.generation", "created": 0, "model": "cosmos3",
            "data": [{"index": i, "input_index": i, "candidate_index": 0,
                      "action": {"type": "continuous", "dtype": "float32", "shape": list(actions[i].shape),
                                 "values": marker(actions[i]), "action_mode": "policy", "domain_id": 5,
                                 "raw_action_dim": raw_action_dim}} for i in order],
            "usage": {"batch_size": len(order), "action_horizon": actions.shape[1], "action_dim": actions.shape[2],
                      "denoise_steps": 30, "prefix_cache_hit": False}}
    return msgpack.packb(body, use_bin_type=True)


def test_decode_sglang_response_padded_and_shuffled():
    acts = np.random.default_rng(0).standard_normal((4, 16, 32)).astype(np.float32)  # padded to 32 channels
    body = decode_body(_sglang_style_response(acts, 7, [3, 1, 0, 2]), "application/msgpack")
    out = decode_sglang_response(body, raw_action_dim=7, expect_n=4)
    assert out.shape == (4, 16, 7) and np.array_equal(out, acts[:, :, :7])
    # JSON list form; raw_action_dim taken from the items when not given
    js = {"object": "action.generation", "data": [{"index": i, "input_index": i, "candidate_index": 0,
                                                   "action": {"values": acts[i].tolist(), "raw_action_dim": 7}}
                                                  for i in (1, 0)]}
    assert np.array_equal(decode_sglang_response(js, None), acts[:2, :, :7])


def test_client_sglang_mode_groups_by_prompt_and_seed_end_to_end():
    """sglang mode against a wamkit server (which accepts SGLang's request form): one image per observation, one
    prompt and one seed per request, so observations are grouped by (prompt, seed) and every one is computed with its
    own seed; height/width are sent (SGLang's default would crop); a batch over the server's limit is split."""
    o = obs(6, tasks=["a", "b", "a"])
    with WamkitServerWorker("random", {"action_dim": 7, "horizon": 16}, max_batch_size=3) as w:
        async def go(seeds):
            async with ActionClient(w.url, mode="sglang", camera="wrist_image",
                                    parameters={"domain_name": "libero", "raw_action_dim": 5}) as c:
                a = await c.predict(o, seeds)
                return a, sorted(t["n"] for t in c.last_timings)
        seeds = [10, 11, 12, 13, 14, 15]
        a, ns = asyncio.run(go(seeds))
        assert ns == [1] * 6
        ref = make_policy("random", action_dim=7, horizon=16).predict(o, seeds)[:, :, :5]
        assert np.array_equal(a, ref)
        a2, ns2 = asyncio.run(go([7] * 6))                  # one seed: prompts a (4 obs, split at 3) and b (2 obs)
        assert ns2 == [1, 2, 3] and a2.shape == (6, 16, 5)
        assert np.array_equal(a2, make_policy("random", action_dim=7, horizon=16).predict(o, [7] * 6)[:, :, :5])
    body = build_sglang_request(o[:2], 3, sglang_parameters(domain_name="libero", raw_action_dim=7),
                                camera="wrist_image")
    assert (body["parameters"]["height"], body["parameters"]["width"]) == (12, 12)


def test_check_sglang_request_refuses_what_sglang_refuses():
    from wamkit.protocol import check_sglang_request

    p = sglang_parameters(domain_name="libero", raw_action_dim=10)
    body = build_sglang_request(obs(3), 5, p)
    check_sglang_request(body, max_batch_size=3)
    with pytest.raises(ValueError, match="batching-max-size=2"):
        check_sglang_request(body, max_batch_size=2)
    for field, value, msg in (("seed", -1, "non-negative"), ("seed", [1, 2], "non-negative"),
                              ("action_horizon", 10, "multiple of 4"), ("num_frames", 16, "action_horizon \\+ 1"),
                              ("action_mode", "inverse_dynamics", "policy")):
        bad = {**body, "parameters": {**body["parameters"], field: value}}
        with pytest.raises(ValueError, match=msg):
            check_sglang_request(bad)
    bad = {**body, "input": {**body["input"], "prompt": ["a", "b"]}}
    with pytest.raises(ValueError, match="2 prompts for 3 images"):
        check_sglang_request(bad)


def _sglang_and_gpu() -> tuple[bool, str]:
    if importlib.util.find_spec("sglang") is None:
        return False, "sglang is not installed"
    try:
        import torch
        if not torch.cuda.is_available():
            return False, "no CUDA GPU"
    except Exception as e:  # pragma: no cover
        return False, f"torch unavailable: {e}"
    if not os.environ.get("WAMKIT_SGLANG_MODEL"):
        return False, "set WAMKIT_SGLANG_MODEL to a diffusers-format action model directory"
    return True, ""


_ok, _why = _sglang_and_gpu()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not _ok, reason=_why or "needs sglang and a CUDA GPU")
def test_real_sglang_server_roundtrip():
    with SGLangServerWorker(os.environ["WAMKIT_SGLANG_MODEL"], batching_max_size=4) as w:
        if not w.has_action_api():
            pytest.skip("this SGLang release has no /v1/actions endpoint")
        side = int(os.environ.get("WAMKIT_SGLANG_SIDE", "256"))

        async def go():
            async with ActionClient(w.url, mode="sglang", timeout_s=600,
                                    parameters={"domain_name": os.environ.get("WAMKIT_SGLANG_DOMAIN", "libero"),
                                                "raw_action_dim": 7, "num_inference_steps": 4}) as c:
                return await c.predict(obs(3, side=side), [0, 1, 2])
        a = asyncio.run(go())
        assert a.shape[0] == 3 and a.shape[2] == 7 and np.isfinite(a).all()


def _standin_post(client, images, **params):
    import json

    body = {"input": {"prompt": "put the bowl on the plate",
                      "image": [{"__ndarray__": True, "dtype": "uint8", "shape": list(im.shape),
                                 "data": im.tobytes()} for im in images]},
            "parameters": {"seed": 1, **params}}
    data = msgpack.packb(body, use_bin_type=True)
    r = client.post("/v1/actions/generations", content=data, headers={"content-type": "application/msgpack"})
    return r.status_code, (json.loads(r.content) if r.headers["content-type"].startswith("application/json")
                           else None)


def test_the_standin_refuses_what_sglang_refuses_and_keeps_serving():
    """cosmos3-standin answers in SGLang's place on the CPU, so it refuses (400, naming the field) what SGLang 0.5.23's
    router refuses; an image of the wrong size is the policy's own input check: 422, not a 500 the client retries."""
    from starlette.testclient import TestClient

    from wamkit.serve.app import create_app
    from wamkit.serve.config import ServeConfig

    cfg = ServeConfig(policy="cosmos3-standin", warmup=False, log_every_s=0, max_wait_ms=1, max_batch_size=4,
                      policy_args={"action_stats": {"q01": [-1.0] * 10, "q99": [1.0] * 10},
                                   "inner_args": {"base_ms": 0}})
    good = np.zeros((192, 320, 3), np.uint8)
    ok = dict(domain_name="libero", raw_action_dim=10, action_horizon=16)
    with TestClient(create_app(cfg)) as c:
        assert c.get("/v1/actions/metadata").json()["capabilities"]["max_batch_size"] == 4
        cases = [([good], dict(domain_name="libero", action_horizon=5, num_frames=6), "parameters.action_horizon"),
                 ([good], dict(raw_action_dim=10), "parameters.domain_name"),
                 ([good], dict(domain_id=5), "parameters.raw_action_dim"),
                 ([good] * 5, ok, "input.image")]
        for images, params, path in cases:
            status, body = _standin_post(c, images, **params)
            assert status == 400 and body["error"]["path"] == path, (params, status, body)
            assert _standin_post(c, [good], **ok)[0] == 200
        status, body = _standin_post(c, [np.zeros((256, 256, 3), np.uint8)], **ok)
        assert status == 422 and "192x320x3" in body["error"]["message"], body
        status, body = _standin_post(c, [good, np.zeros((96, 320, 3), np.uint8)], **ok)
        assert status == 422, body
        assert _standin_post(c, [good] * 4, **ok)[0] == 200
