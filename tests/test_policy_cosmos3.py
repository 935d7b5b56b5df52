"""Cosmos3 adapter: request builder and response decoder against hand-computed examples and scipy; predict through
a fake SGLang server; the cosmos-framework construction path (skipped here: the framework cannot be installed)."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies import make_policy
from wamkit.policies.cosmos3 import io as C

Q01 = np.array([-0.9, -0.8, -0.7, -1, -1, -1, -1, -1, -1, 0.0])
Q99 = np.array([0.9, 0.8, 0.7, 1, 1, 1, 1, 1, 1, 1.0])


def _norm(a10):
    return 2 * (np.asarray(a10, np.float64) - Q01) / (Q99 - Q01) - 1


def test_image_layout_resize_and_reflection_pad():
    h = np.arange(256, dtype=np.uint8)[:, None, None]
    agent = np.broadcast_to(h, (256, 256, 3)).copy()                       # vertical gradient
    wrist = np.full((256, 256, 3), 200, np.uint8)
    img = C.cosmos3_image({"image": agent, "wrist_image": wrist})
    assert img.shape == (192, 320, 3) and img.dtype == np.uint8
    assert (img[:160, 170:] == 200).all()                                  # wrist on the right half
    col = img[:160, 40, 0].astype(int)                                     # agentview on the left, still a ramp
    assert col[0] < 5 and col[-1] > 250 and (np.diff(col) >= 0).all()
    for k in range(32):                                                    # rows 160.. mirror 158.. (reflect)
        np.testing.assert_array_equal(img[160 + k], img[158 - k])
    # a constant pair stays exactly constant through resize + pad
    flat = C.cosmos3_image({"image": np.full((256, 256, 3), 7, np.uint8),
                            "wrist_image": np.full((256, 256, 3), 7, np.uint8)})
    assert (flat == 7).all()
    with pytest.raises(UserError):
        C.cosmos3_image({"image": agent})


def test_prompt_and_framing():
    # recipe (default): the camera layout goes to SGLang's caption framing (concat_view), the task alone as text
    assert C.cosmos3_prompt("put the bowl on the plate") == "put the bowl on the plate"
    assert C.cosmos3_parameters()["action_view_point"] == "concat_view"
    # rlinf: ego_view framing, camera sentences appended to the task (what RLinf's adapter sends)
    p = C.cosmos3_prompt("put the bowl on the plate", framing="rlinf")
    assert p == ("put the bowl on the plate. This video contains concatenated views from multiple camera "
                 "perspectives. The left half shows the third-person view; the right half shows the wrist-mounted "
                 "camera.")
    assert C.cosmos3_prompt("open it.", framing="rlinf").startswith("open it. This video")
    assert C.cosmos3_prompt("open it", num_cameras=1, framing="rlinf") == "open it"
    assert C.cosmos3_parameters(framing="rlinf")["action_view_point"] == "ego_view"
    with pytest.raises(UserError, match="recipe, rlinf"):
        C.cosmos3_parameters(framing="wide")


def test_request_builder():
    from wamkit.protocol.images import decode_image

    obs = [Observation(images={"image": np.zeros((256, 256, 3), np.uint8),
                               "wrist_image": np.ones((256, 256, 3), np.uint8)}, state=None, task="pick up the mug")]
    body = C.build_cosmos3_request(obs * 2, seed=42, binary=True)
    p = body["parameters"]
    assert p["action_mode"] == "policy" and p["domain_name"] == "libero" and p["raw_action_dim"] == 10
    assert p["action_horizon"] == 16 and p["num_frames"] == 17 and p["num_inference_steps"] == 30
    assert p["seed"] == 42 and (p["height"], p["width"]) == (192, 320) and p["fps"] == 20
    assert body["input"]["prompt"] == "pick up the mug" and p["action_view_point"] == "concat_view"
    imgs = body["input"]["image"]
    assert len(imgs) == 2 and decode_image(imgs[0], "image").shape == (192, 320, 3)
    assert json.loads(json.dumps(C.build_cosmos3_request(obs, seed=1, binary=False)))["input"]["image"]["b64_json"]


def test_decoder_hand_computed():
    # 90 degrees about z: R = [[0,-1,0],[1,0,0],[0,0,1]]; first two columns -> rot6d [0,1,0, -1,0,0]
    a10 = np.array([[0.1, -0.2, 0.3, 0, 1, 0, -1, 0, 0, 1.0],      # gripper 1 (open) -> env -1
                    [0.0, 0.0, 0.0, 1, 0, 0, 0, 1, 0, 0.0]])       # identity, gripper 0 (closed) -> env +1
    n = np.zeros((1, 2, 64), np.float32)
    n[0, :, :10] = _norm(a10)
    n[0, :, 10:] = 123.0                                            # padding channels past raw_action_dim
    out = C.decode_cosmos3_actions(n, C.cosmos3_action_pipeline({"q01": Q01, "q99": Q99}))
    expect = np.array([[0.1, -0.2, 0.3, 0, 0, np.pi / 2, -1], [0, 0, 0, 0, 0, 0, 1]], np.float32)
    np.testing.assert_allclose(out[0], expect, atol=1e-5)


def test_decoder_against_scipy_and_envelope_order():
    from scipy.spatial.transform import Rotation

    rng = np.random.default_rng(0)
    rots = Rotation.random(2 * 16, random_state=1)
    R = rots.as_matrix()
    r6 = np.swapaxes(R[:, :, :2], 1, 2).reshape(-1, 6)             # [R00,R10,R20,R01,R11,R21]
    pos, g = rng.uniform(-0.5, 0.5, (32, 3)), rng.uniform(0, 1, (32, 1))
    a10 = np.concatenate([pos, r6, g], 1).reshape(2, 16, 10)
    values = np.concatenate([_norm(a10), np.zeros((2, 16, 54))], -1).astype(np.float32)
    body = {"id": "x", "object": "action.generation", "data": [
        {"index": i, "input_index": i, "candidate_index": 0,
         "action": {"type": "continuous", "dtype": "float32", "shape": [16, 64], "values": values[i].tolist(),
                    "raw_action_dim": 10}} for i in (1, 0)]}         # out of order on purpose
    out = C.decode_cosmos3_response(body, C.cosmos3_action_pipeline({"global_raw": {"q01": Q01, "q99": Q99}}),
                                    expect_n=2)
    exp_rv = rots.as_rotvec().reshape(2, 16, 3)
    np.testing.assert_allclose(out[..., :3], pos.reshape(2, 16, 3), atol=1e-5)
    np.testing.assert_allclose(out[..., 3:6], exp_rv, atol=1e-4)
    np.testing.assert_allclose(out[..., 6], 1 - 2 * g.reshape(2, 16), atol=1e-5)


class _FakeSGLang(BaseHTTPRequestHandler):
    """Answers /v1/actions/generations with normalized actions that encode (seed, batch position)."""

    seen: list = []
    busy = 0          # answer this many next POSTs with 503 Retry-After: 0

    def log_message(self, *a):
        pass

    def _reply(self, obj, binary):
        from wamkit.protocol.codec import encode_body

        data, ctype = encode_body(obj, binary)
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/v1/actions/metadata"):
            self._reply({"capabilities": {"max_batch_size": 8}}, False)
        else:
            self._reply({"ok": True}, False)

    def do_POST(self):
        from wamkit.protocol.codec import decode_body

        body = decode_body(self.rfile.read(int(self.headers["content-length"])), self.headers.get("content-type"))
        if type(self).busy > 0:
            type(self).busy -= 1
            self.send_response(503)
            self.send_header("retry-after", "0")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        imgs = body["input"]["image"]
        imgs = imgs if isinstance(imgs, list) else [imgs]
        seed = int(body["parameters"]["seed"])
        type(self).seen.append((body["input"]["prompt"], seed, len(imgs), body["parameters"]))
        data = []
        for i in range(len(imgs)):
            v = np.zeros((16, 64), np.float32)
            a10 = np.array([seed / 100.0, 0, 0, 1, 0, 0, 0, 1, 0, 1.0])
            v[:, :10] = _norm(a10)
            data.append({"index": i, "input_index": i, "candidate_index": 0,
                         "action": {"type": "continuous", "dtype": "float32", "shape": [16, 64],
                                    "values": v.tolist(), "raw_action_dim": 10}})
        self._reply({"id": "r", "object": "action.generation", "data": data[::-1],
                     "usage": {"batch_size": len(imgs)}}, "msgpack" in (self.headers.get("content-type") or ""))


@pytest.fixture
def fake_sglang():
    _FakeSGLang.seen = []
    _FakeSGLang.busy = 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def _obs3():
    rng = np.random.default_rng(0)
    return [Observation(images={c: rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
                                for c in ("image", "wrist_image")}, state=None, task=t)
            for t in ("open the drawer", "open the drawer", "close it")]


@pytest.mark.parametrize("client", ["own", "injected"])
def test_predict_through_sglang_endpoint(fake_sglang, client):
    """The policy's transport (wamkit.protocol.client in SGLang mode) and an injected one give the same actions;
    with seed=None every observation keeps its own seed, so only same prompt + same seed share a request."""
    stats = {"q01": Q01.tolist(), "q99": Q99.tolist()}
    kw = {}
    if client == "injected":
        from wamkit.protocol.client import SyncActionClient

        kw["client"] = SyncActionClient(fake_sglang, mode="sglang", camera="image",
                                        parameters=C.cosmos3_parameters(30), raw_action_dim=C.RAW_ACTION_DIM)
    pol = make_policy("cosmos3", url=fake_sglang, action_stats=stats, seed=None, **kw)
    obs = _obs3()
    a = pol.predict(obs, [5, 5, 9])
    assert a.shape == (3, 16, 7) and a.dtype == np.float32
    np.testing.assert_allclose(a[:, 0, 0], [0.05, 0.05, 0.09], atol=1e-5)   # row i follows its own seed
    np.testing.assert_allclose(a[..., 3:6], 0, atol=1e-6)
    np.testing.assert_allclose(a[..., 6], -1, atol=1e-6)                     # open
    sizes = sorted(s[2] for s in _FakeSGLang.seen)
    assert sizes == [1, 2]                                                   # same prompt + seed share a batch
    assert all(s[3]["domain_name"] == "libero" and s[3]["raw_action_dim"] == 10 for s in _FakeSGLang.seen)
    assert all((s[3]["height"], s[3]["width"]) == (192, 320) for s in _FakeSGLang.seen)
    pol.close()
    with pytest.raises(UserError):
        make_policy("cosmos3").predict(obs, [0, 1, 2])                          # no url
    with pytest.raises(UserError):
        make_policy("cosmos3", url="http://127.0.0.1:9").predict(obs, [0, 1, 2])  # no stats


def test_fixed_request_seed_batches_by_prompt(fake_sglang):
    """The default: one seed (RLinf's 1140) for every request, so observations of one prompt share a request."""
    pol = make_policy("cosmos3", url=fake_sglang, action_stats={"q01": Q01.tolist(), "q99": Q99.tolist()})
    a = pol.predict(_obs3(), [5, 5, 9])
    np.testing.assert_allclose(a[:, 0, 0], [11.4] * 3, atol=1e-4)               # seed 1140 / 100 for every row
    assert sorted((s[2], s[1]) for s in _FakeSGLang.seen) == [(1, 1140), (2, 1140)]
    pol.close()


def test_normalization_options_refuse_double_denormalization(fake_sglang):
    stats = {"q01": Q01.tolist(), "q99": Q99.tolist()}
    with pytest.raises(UserError, match="applied twice"):
        make_policy("cosmos3", url=fake_sglang, action_stats=stats, normalization="server")
    with pytest.raises(UserError, match="client, server"):
        make_policy("cosmos3", normalization="both")
    # server-side stats: the answer is already in the 10-D training space; only rot6d and the gripper are converted
    pol = make_policy("cosmos3", url=fake_sglang, normalization="server", seed=None)
    a = pol.predict(_obs3()[:1], [50])
    raw = _norm(np.array([0.5, 0, 0, 1, 0, 0, 0, 1, 0, 1.0]))          # what the fake sends, taken as raw here
    np.testing.assert_allclose(a[0, 0, :3], raw[:3], atol=1e-5)
    assert pol.remote_codec().server_normalizes
    pol.close()


def test_batch_limit_comes_from_the_server(fake_sglang):
    """max_request_size=None: the server's metadata (8 here); max_request_size=1 splits every prompt group; 503 Retry-After is
    retried and nothing is lost or doubled."""
    pol = make_policy("cosmos3", url=fake_sglang, action_stats={"q01": Q01.tolist(), "q99": Q99.tolist()},
                      max_request_size=1, seed=None)
    _FakeSGLang.busy = 2                                   # the next two requests get 503 Retry-After: 0
    a = pol.predict(_obs3(), [5, 5, 9])
    np.testing.assert_allclose(a[:, 0, 0], [0.05, 0.05, 0.09], atol=1e-5)
    assert sorted(s[2] for s in _FakeSGLang.seen) == [1, 1, 1]   # answered requests only: three of one
    assert _FakeSGLang.busy == 0
    pol.close()
    _FakeSGLang.seen = []
    pol = make_policy("cosmos3", url=fake_sglang, action_stats={"q01": Q01.tolist(), "q99": Q99.tolist()})
    pol.predict(_obs3() * 4, list(range(12)))             # 8 obs of one prompt -> one request of 8 (server max 8)
    assert sorted(s[2] for s in _FakeSGLang.seen) == [4, 8]
    pol.close()


def test_helpers_for_fsdp():
    import torch

    from wamkit.policies.cosmos3.policy import freeze_outside, promote_scalar_params

    m = torch.nn.Module()
    m.moe_gen = torch.nn.Linear(2, 2)
    m.und = torch.nn.Linear(2, 2)
    m.scale = torch.nn.Parameter(torch.tensor(2.0))
    assert promote_scalar_params(m) == ["scale"] and m.scale.shape == (1,)
    trainable, frozen = freeze_outside(m, ["moe_gen"])
    assert trainable == 6 and frozen == 7
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["moe_gen.weight", "moe_gen.bias"]


FRAMEWORK = importlib.util.find_spec("cosmos_framework") is not None


def test_framework_missing_is_a_clear_error():
    if FRAMEWORK:
        pytest.skip("cosmos-framework is installed")
    with pytest.raises(UserError, match="cosmos_framework"):
        make_policy("cosmos3", framework=True)
    with pytest.raises(UserError, match="cosmos_framework"):
        make_policy("cosmos3").sft_loss({})


@pytest.mark.skipif(not FRAMEWORK, reason="NVIDIA cosmos-framework (module cosmos_framework) is not installed; "
                                          "it needs a CUDA machine")
def test_framework_construction():
    pol = make_policy("cosmos3", framework=True)
    names = [n for n, p in pol.module.net.named_parameters() if p.requires_grad]
    assert names and all(any(k in n for k in pol.keys_to_select) for n in names)
    assert all(p.ndim > 0 for p in pol.module.parameters())
    assert pol.fsdp_units()[-1] is pol.module
