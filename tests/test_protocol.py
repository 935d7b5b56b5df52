"""Protocol layer: message round trips, every image form, validation errors naming field paths, codecs."""

from __future__ import annotations

import base64
import io
import json

import msgpack
import numpy as np
import pytest

from wamkit.core.types import Observation
from wamkit.protocol import (ProtocolError, build_request, build_response, decode_body, decode_image, encode_body,
                             encode_image, parse_request, parse_response)

RNG = np.random.default_rng(0)


def img(h=8, w=6, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def obs_multi(n, state=True):
    return [Observation({"image": img(8, 6, i), "wrist_image": img(4, 4, 100 + i)},
                        np.arange(5, dtype=np.float32) + i if state else None, f"task {i % 2}") for i in range(n)]


def roundtrip(body, binary):
    data, ct = encode_body(body, binary)
    return decode_body(data, ct)


@pytest.mark.parametrize("binary", [True, False])
def test_request_roundtrip_multi_camera_state_seeds(binary):
    obs = obs_multi(3)
    req = parse_request(roundtrip(build_request(obs, [7, 8, 9], {"raw_action_dim": 4}, binary=binary), binary))
    assert len(req) == 3 and req.seeds == [7, 8, 9] and req.parameters == {"raw_action_dim": 4}
    for a, b in zip(req.observations, obs):
        assert a.task == b.task and set(a.images) == {"image", "wrist_image"}
        for k in b.images:
            assert a.images[k].dtype == np.uint8 and np.array_equal(a.images[k], b.images[k])
        assert a.state.dtype == np.float32 and np.array_equal(a.state, b.state)


@pytest.mark.parametrize("binary", [True, False])
def test_response_roundtrip_trims_and_keeps_order(binary):
    req = parse_request(build_request(obs_multi(2, state=False), [1, 2], {"raw_action_dim": 3, "action_horizon": 4}))
    acts = RNG.standard_normal((2, 16, 7)).astype(np.float32)
    body = roundtrip(build_response(req, acts, "m", binary, timing={"queue_ms": 1.0}), binary)
    assert body["object"] == "action.generation" and body["usage"]["batch_size"] == 2
    assert body["usage"]["action_horizon"] == 4 and body["usage"]["action_dim"] == 3
    r = parse_response(body)
    assert np.array_equal(r.actions, acts[:, :4, :3]) and r.timing == {"queue_ms": 1.0}


def test_single_camera_uses_sglang_image_field():
    obs = [Observation({"image": img()}, None, "pick")]
    body = build_request(obs, 3)
    assert "image" in body["input"] and "images" not in body["input"] and body["input"]["task"] == "pick"
    assert body["parameters"]["seed"] == 3


def test_accepts_the_sglang_reference_example():
    """The request from SGLang's contract (one image, int seed, SGLang parameters) is accepted as is."""
    im = img(12, 10)
    body = {"request_id": "r1",
            "input": {"task": "put the bowl on the plate", "image": {"values": im.tolist(), "dtype": "uint8",
                                                                    "shape": [12, 10, 3]}},
            "parameters": {"action_mode": "policy", "domain_name": "libero", "raw_action_dim": 10,
                           "action_horizon": 16, "num_frames": 17, "num_inference_steps": 30, "guidance_scale": 1.0,
                           "seed": 0, "fps": 20, "height": 192, "width": 320},
            "runtime": {"response_format": "envelope", "output_format": "list"}}
    req = parse_request(json.loads(json.dumps(body)))
    assert req.request_id == "r1" and req.seeds == [0] and np.array_equal(req.observations[0].images["image"], im)
    assert req.observations[0].task == "put the bowl on the plate"


def _png_b64(a):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_every_image_form_decodes_to_the_same_pixels():
    a = img(5, 7)
    forms = {
        "raw": encode_image(a, "raw"),
        "raw_b64_text": {"dtype": "uint8", "shape": [5, 7, 3], "bytes": base64.b64encode(a.tobytes()).decode()},
        "ndarray_str_keys": encode_image(a, "ndarray"),
        # SGLang packs its array marker with bytes keys
        "ndarray_bytes_keys": msgpack.unpackb(msgpack.packb({b"__ndarray__": True, b"data": a.tobytes(),
                                                             b"dtype": "|u1", b"shape": (5, 7, 3)}, use_bin_type=True),
                                              raw=False),
        "values": encode_image(a, "values"),
        "b64_json": {"b64_json": _png_b64(a)},
        "data_uri": "data:image/png;base64," + _png_b64(a),
        "data_uri_in_b64_json": {"b64_json": "data:image/png;base64," + _png_b64(a)},
        "lists": a.tolist(),
        "ours_png": encode_image(a, "png"),
    }
    for name, v in forms.items():
        out = decode_image(v, "input.image")
        assert out.dtype == np.uint8 and np.array_equal(out, a), name


def test_batch_array_and_lists_of_images():
    a = np.stack([img(4, 4, i) for i in range(3)])
    req = parse_request({"input": {"image": {"dtype": "uint8", "shape": [3, 4, 4, 3], "bytes": a.tobytes()}},
                         "parameters": {"seed": [1, 2, 3]}})
    assert len(req) == 3 and all(np.array_equal(req.observations[i].images["image"], a[i]) for i in range(3))
    req = parse_request({"input": {"input_reference": [a[0].tolist(), a[1].tolist()], "prompt": ["x", "y"]}})
    assert len(req) == 2 and req.observations[1].task == "y" and req.seeds == [42, 42]   # SGLang's default seed
    req = parse_request({"input": {"images": {"image": a[0].tolist(), "wrist_image": a[1].tolist()},
                                   "state": [0.5, 1.0]}})
    assert len(req) == 1 and req.observations[0].state.tolist() == [0.5, 1.0]


def _bad(body):
    with pytest.raises(ProtocolError) as e:
        parse_request(body)
    return e.value


def raw(a):
    return encode_image(a, "raw")


@pytest.mark.parametrize("body, path, words", [
    ({}, "input", "missing"),
    ({"input": {"task": "x"}}, "input.image", "missing"),
    ({"input": {"image": raw(img())}, "bogus": 1}, "bogus", "unknown field"),
    ({"input": {"image": raw(img()), "camera": 1}}, "input.camera", "unknown field"),
    ({"input": {"image": raw(img())}, "parameters": {"sead": 1}}, "parameters.sead", "unknown field"),
    ({"input": {"image": raw(img())}, "runtime": {"fmt": 1}}, "runtime.fmt", "unknown field"),
    ({"input": {"image": [raw(img())] * 3 + [{"dtype": "uint8", "shape": [8, 6], "bytes": b"\0" * 48}]}},
     "input.image[3].shape", "[H, W, 3]"),
    ({"input": {"image": [raw(img()), {"dtype": "float32", "shape": [8, 6, 3], "bytes": b"\0" * 576}]}},
     "input.image[1].dtype", "uint8"),
    ({"input": {"image": {"dtype": "uint8", "shape": [8, 6, 3], "bytes": b"\0" * 10}}}, "input.image.bytes",
     "needs 144"),
    ({"input": {"images": [{"image": raw(img())}, {"wrist": [[1, 2]]}]}}, "input.images[1].wrist.shape", "[H, W, 3]"),
    ({"input": {"image": [raw(img())] * 2}, "parameters": {"seed": [1, 2, 3]}}, "parameters.seed", "3 seeds"),
    ({"input": {"image": [raw(img())] * 2}, "parameters": {"seed": [1, "a"]}}, "parameters.seed[1]", "integer"),
    ({"input": {"image": [raw(img())] * 2, "task": ["a", "b", "c"]}}, "input.task", "3 prompts"),
    ({"input": {"image": raw(img())}, "parameters": {"action_horizon": 16, "num_frames": 16}},
     "parameters.num_frames", "action_horizon + 1"),
    ({"input": {"image": raw(img())}, "parameters": {"raw_action_dim": "7.5"}}, "parameters.raw_action_dim",
     "integer"),
    ({"input": {"image": [raw(img())] * 2, "state": [[1.0], [2.0], [3.0]]}}, "input.state", "3 states"),
    ({"input": {"image": "/etc/passwd"}}, "input.image", "file paths"),
    ({"input": {"image": {"b64_json": "!!!"}}}, "input.image.b64_json", "base64"),
])
def test_validation_errors_name_the_field(body, path, words):
    e = _bad(body)
    assert e.path == path and words in str(e) and e.status == 400, str(e)


def test_unsupported_but_valid_is_422():
    e = _bad({"input": {"image": raw(img())}, "parameters": {"action_mode": "inverse_dynamics"}})
    assert e.status == 422 and e.path == "parameters.action_mode"
    e = _bad({"input": {"video_path": "x.mp4"}})
    assert e.status == 422 and e.path == "input.video_path"


def test_body_codecs_refuse_garbage_and_ext_types():
    with pytest.raises(ProtocolError, match=r"not valid msgpack \(FormatError: a byte that begins no msgpack"):
        decode_body(b"\xc1\xc1\xc1 not msgpack", "application/msgpack")   # (msgpack's own reason was empty)
    with pytest.raises(ProtocolError, match="extension type"):
        decode_body(msgpack.packb({"a": msgpack.ExtType(5, b"x")}), "application/msgpack")
    with pytest.raises(ProtocolError, match="mapping"):
        decode_body(msgpack.packb([1, 2]), "application/msgpack")
    with pytest.raises(ProtocolError, match="not valid JSON"):
        decode_body(b"{nope", "application/json")
    with pytest.raises(ProtocolError) as e:
        decode_body(b"{}", "text/plain")
    assert e.value.status == 415


def test_group_key_ignores_seed_only():
    o = obs_multi(2, state=False)
    r1 = parse_request(build_request(o, [1, 2], {"num_inference_steps": 10}))
    r2 = parse_request(build_request(o, [5, 6], {"num_inference_steps": 10}))
    r3 = parse_request(build_request(o, [1, 2], {"num_inference_steps": 20}))
    assert r1.group_key(0) == r2.group_key(1) and r1.group_key(0) != r3.group_key(0)
    small = parse_request(build_request([Observation({"image": img(4, 4)}, None, "")], [1]))
    big = parse_request(build_request([Observation({"image": img(8, 8)}, None, "")], [1]))
    assert small.group_key(0) != big.group_key(0)


def test_parse_response_sorts_by_input_index_and_keeps_raw_action_dim():
    vals = [RNG.standard_normal((4, 12)).astype(np.float32) for _ in range(3)]
    body = {"id": "x", "object": "action.generation", "model": "m",
            "data": [{"index": i, "input_index": i, "candidate_index": 0,
                      "action": {"type": "continuous", "dtype": "float32", "shape": [4, 12],
                                 "values": vals[i].tolist(), "raw_action_dim": 7}} for i in (2, 0, 1)],
            "usage": {"batch_size": 3}}
    r = parse_response(body)
    assert r.actions.shape == (3, 4, 7) and np.array_equal(r.actions, np.stack(vals)[:, :, :7])
    with pytest.raises(ProtocolError, match="4 observations"):
        parse_response(body, expect_n=4)
