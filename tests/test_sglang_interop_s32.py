"""Interoperability with SGLang's action API (session 32): what SGLang's own clients send is accepted by `wamkit
serve`, what wamkit's clients send to a server that is not wamkit is what SGLang accepts, and both servers answer
alike. Checked against SGLang's real action router (sglang 0.5.23 with only the model call replaced:
tests/sglang_compat/harness.py in the side venv) where the claim is about SGLang, in process otherwise.

The stand-in model behind both servers is `cosmos3-standin` over `fixed-cost`, whose actions depend only on the
seed, so equal seeds must give equal actions whatever the batching and whichever server answers."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import msgpack
import numpy as np
import pytest
from starlette.testclient import TestClient

from wamkit.core.types import Observation
from wamkit.protocol import ProtocolError, decode_body, encode_body, parse_request
from wamkit.protocol.client import ActionClient, ActionClientError
from wamkit.protocol.limits import DecodeLimits
from wamkit.protocol.openpi import observation_from_openpi
from wamkit.serve import ServeConfig, WamkitServerWorker
from wamkit.serve.app import create_app
from wamkit.serve.ws_client import WebsocketActionClient
from wamkit.serve.ws_codec import error_reply

GEN = "/v1/actions/generations"
PARAMS = {"domain_name": "libero", "raw_action_dim": 10, "action_horizon": 16, "height": 192, "width": 320}
Q = {"q01": [-0.9, -0.8, -0.7, -1, -1, -1, -1, -1, -1, 0.0], "q99": [0.9, 0.8, 0.7, 1, 1, 1, 1, 1, 1, 1.0]}


def img(seed: int = 0) -> np.ndarray:
    """A 192x320 image: the Cosmos3 adapter's side-by-side layout the stand-in reads."""
    return np.random.default_rng(seed).integers(0, 256, (192, 320, 3), dtype=np.uint8)


def obs(n: int, task: str = "pick up the mug") -> list[Observation]:
    return [Observation({"image": img(i)}, None, task) for i in range(n)]


def sg_pack(obj) -> bytes:
    """msgpack as SGLang's pack_msgpack (and openpi's msgpack_numpy) packs: numpy arrays and numpy scalars as
    markers with bytes keys."""
    def default(o):
        if isinstance(o, np.ndarray):
            return {b"__ndarray__": True, b"data": o.tobytes(), b"dtype": o.dtype.str, b"shape": o.shape}
        if isinstance(o, np.generic):
            return {b"__npgeneric__": True, b"data": o.item(), b"dtype": o.dtype.str}
        raise TypeError(type(o))
    return msgpack.packb(obj, default=default, use_bin_type=True)


def sg_unpack(data: bytes):
    """openpi's msgpack_numpy.unpackb: only bytes-keyed markers become arrays."""
    def hook(d):
        if b"__ndarray__" in d:
            return np.ndarray(buffer=d[b"data"], dtype=np.dtype(d[b"dtype"]), shape=d[b"shape"])
        return d
    return msgpack.unpackb(data, object_hook=hook, raw=False)


def _array(v) -> np.ndarray:
    if isinstance(v, dict):   # a str-keyed marker (what sg_unpack leaves as it is)
        return np.frombuffer(v["data"], np.dtype(v["dtype"])).reshape(v["shape"])
    return np.asarray(v, np.float32)


def values(body: dict) -> np.ndarray:
    """(N, H, D) actions of an envelope decoded by sg_unpack or JSON."""
    items = sorted(body["data"], key=lambda d: d["input_index"])
    return np.stack([_array(d["action"]["values"]) for d in items])


@pytest.fixture(scope="module")
def stats(tmp_path_factory):
    p = tmp_path_factory.mktemp("stats") / "stats.json"
    p.write_text(json.dumps(Q))
    return p


@pytest.fixture(scope="module")
def wk(stats):
    """`wamkit serve` standing in for SGLang, in process."""
    cfg = ServeConfig(policy="cosmos3-standin", warmup=False, log_every_s=0, max_wait_ms=1,
                      policy_args={"inner": "fixed-cost", "inner_args": {"base_ms": 0, "per_obs_ms": 0},
                                   "action_stats": str(stats), "max_batch_size": 4})
    with TestClient(create_app(cfg)) as c:
        yield c


@pytest.fixture(scope="module")
def rnd():
    """`wamkit serve` of the random policy ((16, 7) chunks drawn from the seed), in process."""
    with TestClient(create_app(ServeConfig(policy="random", warmup=False, log_every_s=0, max_wait_ms=1))) as c:
        yield c


@pytest.fixture(scope="module")
def sglang(tmp_path_factory, stats):
    """SGLang's real action router (--batching-max-size 4), the same stand-in model."""
    from test_sglang_compat import SGLANG_PY, HarnessWorker

    if not SGLANG_PY.exists():
        pytest.skip("needs the side venv with the sglang wheel: `make sglang-env`")
    log = tmp_path_factory.mktemp("sglang") / "requests.jsonl"
    with HarnessWorker(log, stats, batching_max_size=4) as w:
        w.request_log = log
        yield w


@pytest.fixture(scope="module")
def wk_proc(stats):
    """`wamkit serve` as a process (for the websocket client)."""
    args = {"inner": "fixed-cost", "inner_args.base_ms": 0, "inner_args.per_obs_ms": 0, "action_stats": str(stats),
            "max_batch_size": 4}
    with WamkitServerWorker("cosmos3-standin", args, max_batch_size=4, max_wait_ms=2) as w:
        yield w


def post_both(sglang, wk, body: dict, binary: bool = True, content: bytes | None = None):
    """The same request to SGLang's router and to wamkit: (status, decoded body) of each."""
    if content is None:
        content = sg_pack(body) if binary else json.dumps(body).encode()
    headers = {"content-type": "application/msgpack" if binary else "application/json"}
    if binary:
        headers["accept"] = "application/msgpack"
    out = []
    for r in (httpx.post(sglang.url + GEN, content=content, headers=headers, timeout=120),
              wk.post(GEN, content=content, headers=headers)):
        ok = r.status_code == 200 and binary
        out.append((r.status_code, sg_unpack(r.content) if ok else r.json()))
    return out


def both_ok(sglang, wk, body, binary=True):
    (s1, b1), (s2, b2) = post_both(sglang, wk, body, binary)
    assert (s1, s2) == (200, 200), (b1, b2)
    return b1, b2


def request(inp: dict, **params) -> dict:
    return {"input": {"task": "pick up the mug", **inp}, "parameters": {**PARAMS, "seed": 7, **params}}


# ---------------------------------------------------------------------------------- 1. the clients' forms, seeds
def _run(coro):
    return asyncio.run(coro)


async def _predict(cls, url, o, seeds, **kw):
    async with cls(url, retries=0, parameters=dict(PARAMS), **kw) as c:
        a = await c.predict(o, seeds)
        return a, [t["n"] for t in c.last_timings]


def test_clients_send_sglang_forms_to_sglang_and_seeds_hold_whatever_the_batching(sglang, wk_proc):
    """The sglang-ws client and ActionClient(mode="wamkit") sent wamkit-only forms (a list of {camera: image}, a
    list of seeds) that SGLang refuses; now a server that is not wamkit gets SGLang's batch form with one seed a
    request (observations of equal seed share one). Every route gives the actions each observation gets alone."""
    o, seeds = obs(5), [1, 2, 1, 3, 1]
    alone = np.concatenate([_run(_predict(ActionClient, sglang.url, [x], [s]))[0] for x, s in zip(o, seeds)])
    ws_sg, ns = _run(_predict(WebsocketActionClient, sglang.url, o, seeds, protocol="sglang-ws"))
    assert sorted(ns) == [1, 1, 3]                              # seed 1's three in one frame, as SGLang batches
    http_sg, ns_http = _run(_predict(ActionClient, sglang.url, o, seeds))
    assert sorted(ns_http) == [1, 1, 3]
    mode_sg, _ = _run(_predict(ActionClient, sglang.url, o, seeds, mode="sglang"))
    ws_wk, ns_wk = _run(_predict(WebsocketActionClient, wk_proc.url, o, seeds, protocol="sglang-ws"))
    assert sorted(ns_wk) == [1, 4]                              # wamkit: per-observation seeds in one frame
    http_wk, _ = _run(_predict(ActionClient, wk_proc.url, o, seeds))
    for a in (ws_sg, http_sg, mode_sg, ws_wk, http_wk):
        np.testing.assert_array_equal(a, alone)
    assert not np.array_equal(alone[0], alone[1])               # the seeds do matter


def test_non_wamkit_plan_and_body_are_sglang_forms():
    """Several cameras or a state: one observation a request, images as {camera: image}, the state one vector."""
    from wamkit.protocol.sglang import build_sglang_observation_request, plan_sglang_requests

    rng = np.random.default_rng(0)
    two = [Observation({"image": img(i), "wrist": img(9)}, rng.standard_normal(8).astype(np.float32), "t")
           for i in range(3)]
    assert plan_sglang_requests(two, [5, 5, 5], 4) == [[0], [1], [2]]
    assert plan_sglang_requests(obs(3), [5, 6, 5], 4) == [[0, 2], [1]]
    body = build_sglang_observation_request(two[:1], 5, {}, "array")
    assert set(body["input"]["images"]) == {"image", "wrist"} and body["input"]["state"].shape == (8,)
    assert body["parameters"]["seed"] == 5
    batch = build_sglang_observation_request(obs(2), 5, {}, "ndarray")
    assert list(batch["input"]["images"]) == ["image"] and len(batch["input"]["images"]["image"]) == 2
    with pytest.raises(ValueError, match="one camera"):
        build_sglang_observation_request(two[:2], 5, {}, "array")
    req = parse_request(decode_body(*encode_body(batch, True)))     # and wamkit reads it as SGLang does
    assert len(req) == 2 and req.seeds == [5, 5]


# ------------------------------------------------------------------- 2, 3: SGLang's input forms accepted by wamkit
@pytest.mark.parametrize("form", ["images list", "images 4-D", "observation", "observation + override",
                                  "observation.images.<cam>"])
def test_sglang_input_forms_give_sglangs_actions(sglang, wk, form):
    a, b = img(1), img(2)
    inp = {"images list": {"images": {"image": [a, b]}},
           "images 4-D": {"images": {"image": np.stack([a, b])}},
           "observation": {"observation": {"images": {"image": a}}},
           "observation + override": {"observation": {"images": {"image": b}, "prompt": "x"}, "images": {"image": a}},
           "observation.images.<cam>": {"observation": {"observation.images.image": a}}}[form]
    body = request(inp)
    if form == "observation.images.<cam>":   # SGLang's Cosmos3 path reads observation.images only; wamkit both
        (s1, _), (s2, b2) = post_both(sglang, wk, body)
        assert s2 == 200 and s1 == 400
        return
    b1, b2 = both_ok(sglang, wk, body)
    np.testing.assert_array_equal(values(b1), values(b2))
    assert values(b2).shape[0] == (2 if "images" in form and "observation" not in form else 1)


def test_bad_batched_images_and_refused_observation_fields_name_the_field(wk):
    a = img(0)
    for inp, path, status in [({"images": {"image": [a, a], "wrist": a}}, "input.images", 400),
                              ({"observation": {"noise": [1.0]}}, "input.observation.noise", 422),
                              ({"observation": {"video_path": "x.mp4"}}, "input.observation.video_path", 422),
                              ({"observation": {"tokens": [1]}}, "input.observation.tokens", 400),
                              ({"observation": {"state": [1.0], "observation.state": [1.0], "image": a}},
                               "input.observation.observation.state", 400),
                              ({"image_path": "/x.png"}, "input.image_path", 422)]:
        r = wk.post(GEN, content=sg_pack(request(inp)), headers={"content-type": "application/msgpack"})
        assert (r.status_code, r.json()["error"]["path"]) == (status, path), r.text


def test_the_sglang_bench_clients_request_is_served(wk):
    """bench_pi05_openpi.py's build_sglang_payload: input.task + input.observation {images: {cam: {values, dtype,
    shape}}, state: {values, dtype, shape}}, parameters, runtime with prefix_cache/cuda_graph/response_format."""
    def tensor(x):
        return {"dtype": str(x.dtype), "shape": list(x.shape), "values": x.tolist()}
    body = {"model": "pi05", "input": {"task": "t", "observation": {"images": {"image": tensor(img(3))},
                                                                    "state": tensor(np.zeros(8, np.float32))}},
            "parameters": {**PARAMS, "num_inference_steps": 10},
            "runtime": {"return_timing": True, "prefix_cache": True, "cuda_graph": True,
                        "response_format": "envelope"}}
    r = wk.post(GEN, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["denoise_steps"] == 10 and "timings" in r.json()


# ------------------------------------------------------------------------------------ 4: numpy scalars in msgpack
def test_numpy_scalars_from_sglangs_packer(sglang, wk):
    body = request({"image": img(4)}, seed=np.int64(7), action_horizon=np.int64(16), guidance_scale=np.float32(1.0))
    b1, b2 = both_ok(sglang, wk, body)
    np.testing.assert_array_equal(values(b1), values(b2))
    ref = wk.post(GEN, content=sg_pack(request({"image": img(4)}, seed=7)),
                  headers={"content-type": "application/msgpack", "accept": "application/msgpack"})
    np.testing.assert_array_equal(values(sg_unpack(ref.content)), values(b2))


def test_numpy_scalar_markers_are_checked_naming_the_field():
    d = decode_body(sg_pack({"a": [np.int8(3), {"b": np.bool_(True)}], "c": np.float64(0.5)}), "application/msgpack")
    assert d == {"a": [3, {"b": True}], "c": 0.5} and type(d["c"]) is float
    bad = msgpack.packb({"p": {"s": {b"__npgeneric__": True, b"data": "x", b"dtype": "<i8"}}}, use_bin_type=True)
    with pytest.raises(ProtocolError) as e:
        decode_body(bad, "application/msgpack")
    assert e.value.path == "p.s" and e.value.status == 400


def test_numpy_scalars_in_an_openpi_frame(rnd):
    frame = {"observation/image": img(5)[:8, :8], "prompt": "t", "seed": np.int64(9)}
    with rnd.websocket_connect("/openpi/policy") as ws:
        ws.receive_bytes()
        ws.send_bytes(sg_pack(frame))
        got = sg_unpack(ws.receive_bytes())["actions"]
        ws.send_bytes(sg_pack({**frame, "seed": 9}))
        np.testing.assert_array_equal(got, sg_unpack(ws.receive_bytes())["actions"])


# ------------------------------------------------------------------------------------ 5: parameters in openpi frames
def test_openpi_frames_carry_parameters_as_sglang_reads_them(rnd):
    frame = {"observation/image": img(6)[:8, :8], "prompt": "t", "seed": 3, "action_horizon": 8, "raw_action_dim": 5,
             "num_inference_steps": 5, "guidance_scale": 1.0, "enable_pi_prefix_cache": True}
    with rnd.websocket_connect("/openpi/policy") as ws:
        ws.receive_bytes()
        ws.send_bytes(sg_pack(frame))
        a = sg_unpack(ws.receive_bytes())["actions"]
        assert a.shape == (8, 5)
        ws.send_bytes(sg_pack({k: v for k, v in frame.items() if k not in ("action_horizon", "raw_action_dim")}))
        np.testing.assert_array_equal(sg_unpack(ws.receive_bytes())["actions"][:8, :5], a)
        ws.send_bytes(sg_pack({**frame, "action_horizn": 8}))
        err = json.loads(ws.receive_text())["error"]
        assert (err["code"], err["path"]) == (400, "action_horizn")
        ws.send_bytes(sg_pack({**frame, "num_inference_steps": "many"}))
        assert json.loads(ws.receive_text())["error"]["path"] == "num_inference_steps"
        ws.send_bytes(sg_pack({**frame, "action_horizon": 100}))   # refused by the policy's check: the frame's key
        err = json.loads(ws.receive_text())["error"]
        assert (err["code"], err["path"]) == (422, "action_horizon"), err
    from wamkit.protocol.openpi import openpi_request

    req = openpi_request({"image": img(0), "num_frames": 9}, DecodeLimits())
    assert req.parameters == {"action_horizon": 8} and req.seeds == [42]


# ------------------------------------------------------------------------------ 6, 7, 8: defaults and lenient inputs
def test_default_seed_is_sglangs(sglang, wk):
    body = request({"image": img(7)})
    del body["parameters"]["seed"]
    b1, b2 = both_ok(sglang, wk, body)
    np.testing.assert_array_equal(values(b1), values(b2))
    forty_two = both_ok(sglang, wk, request({"image": img(7)}, seed=42))[1]
    np.testing.assert_array_equal(values(forty_two), values(b2))
    assert observation_from_openpi({"image": img(0)})[1] == 42


def test_num_frames_alone_gives_the_horizon(sglang, wk):
    p = {k: v for k, v in PARAMS.items() if k != "action_horizon"}
    body = {"input": {"task": "t", "image": img(8)}, "parameters": {**p, "num_frames": 9, "seed": 1}}
    r = wk.post(GEN, content=sg_pack(body), headers={"content-type": "application/msgpack"})
    assert r.status_code == 200 and sg_unpack(r.content)["usage"]["action_horizon"] == 8
    body["parameters"]["num_frames"] = 8                     # horizon 7: Cosmos3's VAE needs a multiple of 4
    (s1, _), (s2, b2) = post_both(sglang, wk, body)
    assert (s1, s2) == (400, 400) and b2["error"]["path"] == "parameters.num_frames", b2


@pytest.mark.parametrize("lenient", [{"seed": "7"}, {"seed": 7.0}, {"num_inference_steps": "30"},
                                     {"action_mode": " Policy "}, {"action_horizon": 16.0}])
def test_lenient_values_sglang_takes(sglang, wk, lenient):
    b1, b2 = both_ok(sglang, wk, request({"image": img(9)}, **lenient))
    strict = both_ok(sglang, wk, request({"image": img(9)}))[1]
    np.testing.assert_array_equal(values(b2), values(strict))
    np.testing.assert_array_equal(values(b1), values(b2))


@pytest.mark.parametrize("params, path", [({"seed": "7.5"}, "parameters.seed"), ({"foo": 1}, "parameters.foo"),
                                          ({"num_inference_steps": 7.5}, "parameters.num_inference_steps"),
                                          ({"guidance_scale": "nan"}, "parameters.guidance_scale")])
def test_still_refused_naming_the_field(wk, params, path):
    r = wk.post(GEN, json=request({"image": img(0)[:8, :8].tolist()}, **params))
    assert r.status_code == 400 and r.json()["error"]["path"] == path, r.text


def test_task_and_prompt_together_and_unknown_top_level_keys_are_still_refused(wk):
    small = img(0)[:8, :8].tolist()
    r = wk.post(GEN, json={"input": {"task": "a", "prompt": "b", "image": small}})
    assert r.status_code == 400 and r.json()["error"]["path"] == "input.prompt"
    r = wk.post(GEN, json={**request({"image": small}), "extra_body": {}})
    assert r.status_code == 400 and r.json()["error"]["path"] == "extra_body"


# ---------------------------------------------------------------------------------- 9, 10, 13: response shapes
def test_raw_response_format_is_sglangs(sglang, wk):
    for n in (1, 2):
        body = request({"image": [img(i) for i in range(n)] if n > 1 else img(0)})
        body["runtime"] = {"response_format": "raw"}
        b1, b2 = both_ok(sglang, wk, body)
        assert {"request_id", "actions", "action_mode", "raw_action_dim"} <= set(b1) & set(b2)
        assert isinstance(b2["actions"], np.ndarray) and b2["actions"].shape == b1["actions"].shape
        np.testing.assert_array_equal(b1["actions"], b2["actions"])
    body["runtime"] = {"response_format": "RAW"}
    r = wk.post(GEN, json=json.loads(json.dumps(body, default=lambda a: a.tolist())))
    assert r.status_code == 200 and np.asarray(r.json()["actions"]).shape == (2, 16, 10)


def test_http_msgpack_values_are_arrays_for_sglangs_unpacker(sglang, wk):
    b1, b2 = both_ok(sglang, wk, request({"image": img(1)}))
    for b in (b1, b2):
        assert isinstance(b["data"][0]["action"]["values"], np.ndarray)


def test_envelope_has_sglangs_fields(sglang, wk):
    body = request({"image": img(2)}, domain_id=5)
    del body["parameters"]["seed"]
    b1, b2 = both_ok(sglang, wk, body)
    assert set(b1) <= set(b2) and set(b1["usage"]) <= set(b2["usage"])
    assert set(b1["data"][0]["action"]) <= set(b2["data"][0]["action"])
    assert b2["usage"]["prefix_cache_hit"] is False and "timing" in b2
    assert all(isinstance(v, float) for v in b2["timings"].values()) and "compute_ms" in b2["timings"]


def test_denoise_steps_default_is_the_policys():
    from wamkit.policies.base import PolicySpec
    from wamkit.policies.simple import RandomPolicy

    pol = RandomPolicy()
    pol.spec = PolicySpec("steps", extra={"num_inference_steps": 7})
    with TestClient(create_app(ServeConfig(warmup=False, log_every_s=0), pol)) as c:
        body = {"input": {"image": img(0)[:8, :8].tolist()}}
        assert c.post(GEN, json=body).json()["usage"]["denoise_steps"] == 7
        body["parameters"] = {"num_inference_steps": 3}   # not applied (predict takes no steps): not reported
        assert c.post(GEN, json=body).json()["usage"]["denoise_steps"] == 7
        assert c.get("/v1/actions/metadata").json()["defaults"]["num_inference_steps"] == 7


# ------------------------------------------------------------------------------------ 11: SGLang's error frames
def test_sglang_ws_validation_error_is_one_line_and_not_retried(sglang, caplog):
    async def go():
        async with WebsocketActionClient(sglang.url, protocol="sglang-ws", retries=4, backoff=2.0,
                                         parameters={"action_horizon": 16}) as c:
            await c.predict(obs(1), [1])
    with caplog.at_level(logging.WARNING, logger="wamkit.client"), pytest.raises(ActionClientError) as e:
        _run(go())
    msg = str(e.value)
    assert e.value.status == 400 and "\n" not in msg and "Traceback" not in msg
    assert "ValueError: Cosmos3 action requests require domain_name or domain_id" in msg
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def test_traceback_replies_are_read_by_their_last_line():
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nValueError: bad seed\n'
    r = error_reply({"error": tb})
    assert (str(r), r.status) == ("ValueError: bad seed", 400)
    r = error_reply({"error": tb.replace("ValueError: bad seed", "RuntimeError: CUDA out of memory")})
    assert (str(r), r.status) == ("RuntimeError: CUDA out of memory", 500)
    assert error_reply(tb).status == 400 and error_reply("plain text").status == 500


# ------------------------------------------------------------------------------- 14, 15, 16: metadata, auth, metrics
def test_metadata_has_sglangs_keys(sglang, wk):
    sg = httpx.get(sglang.url + "/v1/actions/metadata").json()
    md = wk.get("/v1/actions/metadata").json()
    assert set(sg) <= set(md)
    for part in ("input", "output", "runtime", "defaults", "capabilities"):
        assert set(sg[part]) <= set(md[part]), part
    assert set(sg["runtime"]["parallelism"]) <= set(md["runtime"]["parallelism"])
    assert md["input"]["image_size"] is None and md["model_path"] is None and md["defaults"]["seed"] == 42


def test_metadata_image_size_is_h_w():
    from wamkit.policies.base import InputSpec, PolicySpec
    from wamkit.policies.simple import RandomPolicy

    pol = RandomPolicy()
    pol.spec = PolicySpec("sized", input=InputSpec(cameras=("image",), image_size=224))
    with TestClient(create_app(ServeConfig(warmup=False, log_every_s=0), pol)) as c:
        md = c.get("/v1/actions/metadata").json()
    assert md["input"]["image_size"] == [224, 224] and (md["defaults"]["height"], md["defaults"]["width"]) == (224, 224)


def test_api_key_is_accepted_on_http_as_on_websockets():
    cfg = ServeConfig(policy="random", warmup=False, log_every_s=0, token="s3cret")
    with TestClient(create_app(cfg)) as c:
        body = {"input": {"image": img(0)[:4, :4].tolist()}}
        for auth, status in [("Bearer s3cret", 200), ("Api-Key s3cret", 200), ("api-key s3cret", 200),
                             ("Api-Key wrong", 401), ("Token s3cret", 401), (None, 401)]:
            h = {"authorization": auth} if auth else {}
            assert c.post(GEN, json=body, headers=h).status_code == status, auth
            assert c.get("/v1/actions/metadata", headers=h).status_code == status, auth


def test_a_fresh_server_exposes_every_counter_at_zero():
    parser = pytest.importorskip("prometheus_client.parser")
    with TestClient(create_app(ServeConfig(policy="random", warmup=False, log_every_s=0))) as c:
        text = c.get("/metrics/prometheus").text
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in ("requests", "observations", "batches", "rejected_busy", "decode_unexpected", "body_timeouts",
                 "ws_connections", "closed_header_timeout", "closed_connection_cap", "closed_websocket_cap"):
        assert [s.value for s in fams[f"wamkit_{name}"].samples] == [0], name


# ------------------------------------------------------------------------------ review of session 32
def test_a_long_dtype_string_is_refused_before_numpy_parses_it(monkeypatch):
    """numpy took seconds (holding the GIL) to parse a multi-MB structured dtype sent as a numpy-scalar marker."""
    import msgpack

    from wamkit.protocol import ProtocolError, decode_body
    from wamkit.protocol import limits
    from wamkit.protocol.limits import MAX_DTYPE_CHARS, parse_dtype

    parsed: list[str] = []
    real = np.dtype
    monkeypatch.setattr(limits.np, "dtype", lambda d, *a, **k: (
        parsed.append(d) if isinstance(d, str) and len(d) > MAX_DTYPE_CHARS else None) or real(d, *a, **k))
    body = msgpack.packb({"parameters": {"seed": {b"__npgeneric__": True, b"data": 7, b"dtype": "i8," * 500_000}}},
                         use_bin_type=True)
    with pytest.raises(ProtocolError) as ei:
        decode_body(body, "application/msgpack")
    assert ei.value.path == "parameters.seed" and parsed == []          # refused before numpy saw the string
    with pytest.raises(ValueError, match=f"at most {MAX_DTYPE_CHARS}"):
        parse_dtype("<f4," * 20)
    assert parse_dtype("<f4") == np.float32


def test_observation_cameras_join_the_top_level_images_as_sglang_merges_them():
    from wamkit.protocol import ProtocolError
    from wamkit.protocol.messages import parse_request

    im = img(1)[:8, :8]
    r = parse_request({"input": {"observation": {"observation.images.wrist": im}, "images": {"image": im}}})
    assert sorted(r.observations[0].images) == ["image", "wrist"]          # input.images dropped the wrist camera
    r = parse_request({"input": {"observation": {"images": {"a": im}}, "images": {"b": im}}})
    assert sorted(r.observations[0].images) == ["b"]                       # input.images replaces the observation's
    with pytest.raises(ProtocolError) as ei:
        parse_request({"input": {"observation": {"observation.images.wrist": im}, "image": im}})
    assert ei.value.path == "input.observation.observation.images.wrist" and "input.image" in str(ei.value)


def test_sglang_form_requests_carry_the_images_size_as_build_sglang_request_does():
    """Without height/width SGLang's Cosmos3 resizes and crops every image to 480x832: the clients' SGLang forms
    (mode=wamkit against another server, sglang-ws) preprocessed otherwise than mode=sglang."""
    from wamkit.core.types import Observation
    from wamkit.protocol.sglang import build_sglang_observation_request

    o = Observation(images={"image": np.zeros((6, 10, 3), np.uint8)}, state=None, task="t")
    assert build_sglang_observation_request([o, o], 5, {}, "array")["parameters"] == {"height": 6, "width": 10,
                                                                                      "seed": 5}
    assert build_sglang_observation_request([o], 5, {"height": 4}, "array")["parameters"]["height"] == 4


def test_metadata_model_path_is_an_export_directory_only(tmp_path, monkeypatch):
    """A registered name ("random") reported a model_path where the server's working directory had a folder of that
    name."""
    from wamkit.serve.metadata import model_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "random").mkdir()
    assert model_path("random") is None
