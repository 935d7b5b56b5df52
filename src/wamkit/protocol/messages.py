"""Typed messages of ``POST /v1/actions/generations`` (SGLang's action API) plus wamkit's extensions.

Request (SGLang's fields; wamkit extensions marked +)::

    {"request_id": str,
     "input": {"task" | "prompt": str | [str] * N,
               "image" | "input_reference": image | [image] * N,        # camera "image"
               + "images": {camera: image} | [{camera: image, ...}] * N, # several cameras per observation
               + "state": [float array] * N},                            # proprio, one per observation
     "parameters": {"action_mode": "policy", "domain_name", "raw_action_dim", "action_horizon", "num_frames",
                    "num_inference_steps", "guidance_scale", "seed": int | + [int] * N, "fps", "height", "width", ...},
     "runtime": {"response_format": "envelope", "output_format": "list" | "numpy"}}

Response (envelope)::

    {"id", "object": "action.generation", "created", "model",
     "data": [{"index", "input_index", "candidate_index", "action": {"type", "dtype", "shape", "values",
                                                                     "action_mode", "domain_id", "raw_action_dim"}}],
     "usage": {"batch_size", "action_horizon", "action_dim", "denoise_steps"},
     + "timing": {"queue_ms", "compute_ms", "batch_size", "t_start", "t_end"}}

Validation errors raise ProtocolError naming the field path (``input.image[3].shape``). Unknown fields are refused
(a typo must not silently change behaviour); SGLang parameters wamkit does not interpret are accepted, passed to the
batch grouping key, and otherwise ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from wamkit.core.types import Observation
from wamkit.protocol.errors import ProtocolError
from wamkit.protocol.images import decode_image, encode_image
from wamkit.protocol.limits import MAX_DIM, DecodeLimits, ImageBudget, check_count

DEFAULT_CAMERA = "image"  # camera key of SGLang's single `image` field (LeRobot LIBERO: agentview)
OBJECT = "action.generation"

# Parameters wamkit interprets, with their types.
_INT_PARAMS = ("raw_action_dim", "action_dim", "action_horizon", "num_frames", "num_inference_steps", "fps", "height",
               "width", "domain_id", "candidate_count", "max_sequence_length", "action_fps")
_FLOAT_PARAMS = ("guidance_scale", "guidance_scale_action", "flow_shift")
_STR_PARAMS = ("action_mode", "domain_name", "action_view_point", "action_normalization", "condition_video_keep",
               "candidate_reducer", "output_format")
_ANY_PARAMS = ("condition_frame_indexes", "use_guardrails", "return_candidates")
PARAMETER_NAMES = frozenset(_INT_PARAMS + _FLOAT_PARAMS + _STR_PARAMS + _ANY_PARAMS + ("seed",))
INPUT_NAMES = frozenset(("task", "prompt", "image", "input_reference", "images", "state"))
RUNTIME_NAMES = frozenset(("response_format", "output_format", "return_timing", "prefix_cache", "cuda_graph"))
TOP_NAMES = frozenset(("request_id", "id", "model", "input", "parameters", "runtime", "return_timing"))
_SGLANG_ONLY_INPUTS = ("image_path", "video", "video_path", "observation", "noise")


# ----------------------------------------------------------------------------------------------------- messages
@dataclass
class Runtime:
    response_format: str = "envelope"
    output_format: str | None = None      # None: "numpy" for msgpack responses, "list" for JSON (as SGLang)
    return_timing: bool = True


@dataclass
class ActionRequest:
    request_id: str
    observations: list[Observation]
    seeds: list[int]
    parameters: dict[str, Any]            # validated SGLang parameters, without "seed"
    runtime: Runtime = field(default_factory=Runtime)

    def __len__(self) -> int:
        return len(self.observations)

    def param_key(self) -> str:
        """Canonical text of every parameter except the seed (observations with different keys never share a batch)."""
        return json.dumps(self.parameters, sort_keys=True, default=str)

    def group_key(self, i: int) -> tuple:
        """Batch compatibility key of observation i: parameters (not seed) + observation_key."""
        return (self.param_key(), *observation_key(self.observations[i]))


def observation_key(o: Observation) -> tuple:
    """What observations must share to go in one policy call: camera names and shapes, state length (tasks may
    differ)."""
    cams = tuple(sorted((k, tuple(v.shape)) for k, v in o.images.items()))
    return cams, None if o.state is None else int(o.state.shape[0])


@dataclass
class ActionResponse:
    id: str
    model: str
    actions: np.ndarray                  # float32 (N, H, D): sorted by input_index, first raw_action_dim channels
    usage: dict[str, Any]
    timing: dict[str, Any] | None
    body: dict[str, Any]                 # the decoded envelope as received (values left as they came)


# ---------------------------------------------------------------------------------------------- helpers
def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _expect_mapping(x: Any, path: str) -> dict:
    if not isinstance(x, dict):
        raise ProtocolError(path, f"expected a mapping, got {type(x).__name__}")
    return x


def _refuse_unknown(d: dict, allowed: frozenset, path: str) -> None:
    for k in d:
        if k not in allowed:
            p = f"{path}.{k}" if path else str(k)
            raise ProtocolError(p, f"unknown field; valid fields: {', '.join(sorted(allowed))}")


def _list_or_one(x: Any) -> tuple[list, bool]:
    return (list(x), True) if isinstance(x, (list, tuple)) else ([x], False)


def _is_nested_pixel_list(x: Any) -> bool:
    """True for one image sent as nested lists (H x W x 3), as opposed to a list of images."""
    try:
        return isinstance(x, list) and isinstance(x[0], list) and isinstance(x[0][0], list) and \
            not isinstance(x[0][0][0], (list, dict))
    except (IndexError, TypeError):
        return False


def _decode_image_list(value: Any, path: str, budget: ImageBudget) -> list[np.ndarray]:
    """`image`: one image (maybe an [N,H,W,3] batch) or a list of images -> list of (H, W, 3)."""
    if isinstance(value, list) and not _is_nested_pixel_list(value):
        if not value:
            raise ProtocolError(path, "empty image list")
        check_count(len(value), budget.limits, path)
        out = []
        for i, v in enumerate(value):
            out.append(decode_image(v, f"{path}[{i}]", budget=budget))
        return out
    arr = decode_image(value, path, allow_batch=True, budget=budget)
    if arr.ndim == 4:
        check_count(arr.shape[0], budget.limits, path)
    return list(arr) if arr.ndim == 4 else [arr]


def _array_shape(shape: Any, path: str) -> list[int]:
    """A declared array shape: a list of at most 4 ints, each in 0..MAX_DIM."""
    if not isinstance(shape, (list, tuple)) or len(shape) > 4 or not all(_is_int(s) for s in shape):
        raise ProtocolError(path + ".shape", f"expected a list of at most 4 ints, got {str(shape)[:80]}")
    for s in shape:
        if not 0 <= s <= MAX_DIM:
            raise ProtocolError(path + ".shape", f"dimensions must be in 0..{MAX_DIM}, got {list(shape)}")
    return [int(s) for s in shape]


def _finite_f32(arr: np.ndarray, path: str) -> np.ndarray:
    """Cast to float32 and refuse NaN/inf, including finite float64 values that overflow float32 (1e300)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(np.float32)
    if not np.all(np.isfinite(out)):
        raise ProtocolError(path, "values must be finite float32 numbers (no NaN/inf, |x| < 3.4e38)")
    return out


def _decode_float_array(value: Any, path: str) -> np.ndarray:
    """A float vector/matrix: list of numbers, {values,dtype,shape}, {dtype,shape,bytes} or the ndarray marker.
    Always finite float32."""
    if isinstance(value, dict):
        def g(k):
            return value[k] if k in value else value.get(k.encode())
        raw = g("bytes") if g("bytes") is not None else (g("data") if g("__ndarray__") is not None else None)
        dtype = g("dtype")
        if isinstance(dtype, bytes):
            dtype = dtype.decode("ascii", "replace")
        if dtype is not None and not isinstance(dtype, str):
            raise ProtocolError(path + ".dtype", f"expected a dtype string, got {type(dtype).__name__}")
        try:
            dt = np.dtype(dtype or "float32")
        except (TypeError, ValueError, SyntaxError):
            raise ProtocolError(path + ".dtype", f"unknown dtype {dtype[:40]!r}") from None
        if dt.kind not in "fiu" or dt.itemsize > 8:
            raise ProtocolError(path + ".dtype", f"expected a numeric dtype of at most 8 bytes, got {dtype!r}")
        shape = g("shape")
        if raw is not None:
            shape = _array_shape(shape, path)
            n = math.prod(shape) * dt.itemsize   # python ints: no int64 overflow
            if isinstance(raw, str):
                if len(raw) > 4 * (n // 3 + 1) + 4:
                    raise ProtocolError(path, f"base64 text too long for shape {shape} and dtype {dt}")
                try:
                    raw = base64.b64decode(raw, validate=True)
                except (binascii.Error, ValueError):
                    raise ProtocolError(path, "expected raw bytes or base64 text") from None
            if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != n:
                raise ProtocolError(path, f"byte length does not match shape {shape} and dtype {dt}")
            arr = np.frombuffer(raw, dt).reshape(shape)
        elif "values" in value:
            arr = _decode_float_array(value["values"], path + ".values")
            if shape is not None:
                shape = _array_shape(shape, path)
                if math.prod(shape) != arr.size:
                    raise ProtocolError(path + ".shape", f"{shape} does not match {arr.size} values")
                arr = arr.reshape(shape)
        else:
            raise ProtocolError(path, "expected {values, dtype, shape} or {dtype, shape, bytes}")
        return _finite_f32(arr, path)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        raise ProtocolError(path, "expected numbers (a flat or rectangular list)") from None
    if arr.dtype.kind not in "fiu" or arr.ndim > 4:
        raise ProtocolError(path, "expected numbers (a flat or rectangular list)")
    return _finite_f32(arr, path)


def _decode_states(value: Any, n: int, path: str) -> list[np.ndarray]:
    """`input.state`: a list of N vectors, an (N, S) array, or (when N == 1) one vector."""
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value):
        vecs = [_decode_float_array(value, path)]
    elif isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(path, f"has {len(value)} states for {n} observations")
        vecs = [_decode_float_array(v, f"{path}[{i}]") for i, v in enumerate(value)]
    else:
        arr = _decode_float_array(value, path)
        vecs = list(arr) if arr.ndim == 2 else [arr]
    if len(vecs) != n:
        raise ProtocolError(path, f"has {len(vecs)} states for {n} observations")
    for i, v in enumerate(vecs):
        if v.ndim != 1 or v.shape[0] == 0:
            raise ProtocolError(f"{path}[{i}].shape", f"a state must be a non-empty 1-D vector, got {list(v.shape)}")
    return [np.ascontiguousarray(v) for v in vecs]


_MAX_PARAM_INT = 2 ** 31 - 1
MAX_SEED = 2 ** 63 - 1   # seeds are 0..2**63-1 on every route (int64 for numpy and torch generators)


def _validate_parameters(params: dict, n: int, limits: DecodeLimits) -> tuple[dict[str, Any], list[int]]:
    _refuse_unknown(params, PARAMETER_NAMES, "parameters")
    out: dict[str, Any] = {}
    for k, v in params.items():
        p = f"parameters.{k}"
        if k == "seed":
            continue
        if v is None:
            continue
        if k in _INT_PARAMS:
            if not _is_int(v):
                raise ProtocolError(p, f"expected an integer, got {v!r}")
            v = int(v)
            if k != "domain_id" and v <= 0:
                raise ProtocolError(p, f"must be positive, got {v}")
            if abs(v) > _MAX_PARAM_INT:
                raise ProtocolError(p, f"must be at most {_MAX_PARAM_INT} in magnitude, got {v}")
        elif k in _FLOAT_PARAMS:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ProtocolError(p, f"expected a number, got {v!r}")
            v = float(v)
        elif k in _STR_PARAMS:
            if not isinstance(v, str):
                raise ProtocolError(p, f"expected a string, got {str(v)[:40]}")
            if len(v) > limits.max_text_chars:
                raise ProtocolError(p, f"longer than {limits.max_text_chars} characters")
        elif isinstance(v, (dict, list)):   # _ANY_PARAMS: a scalar or a flat list of scalars, kept small
            if isinstance(v, dict) or len(v) > limits.max_param_items or \
                    any(isinstance(x, (dict, list, bytes)) for x in v):
                raise ProtocolError(p, f"expected a scalar or a flat list of at most {limits.max_param_items} "
                                       f"scalars")
        elif isinstance(v, (str, bytes)) and len(v) > limits.max_text_chars:
            raise ProtocolError(p, f"longer than {limits.max_text_chars} characters")
        out[k] = v
    mode = out.get("action_mode", "policy")
    if mode != "policy":
        raise ProtocolError("parameters.action_mode", f"only 'policy' is served here, got {mode!r}", status=422)
    if out.get("candidate_count", 1) > 1:
        raise ProtocolError("parameters.candidate_count", "several candidates per observation are not served here",
                            status=422)
    h, nf = out.get("action_horizon"), out.get("num_frames")
    if h is not None and nf is not None and nf != h + 1:
        raise ProtocolError("parameters.num_frames", f"must equal action_horizon + 1 ({h + 1}), got {nf}")
    seed = params.get("seed", 0)
    if seed is None:
        seed = 0
    if _is_int(seed):
        if not 0 <= seed <= MAX_SEED:
            raise ProtocolError("parameters.seed", f"must be in 0..2**63-1, got {seed}")
        seeds = [int(seed)] * n
    elif isinstance(seed, list):
        if len(seed) != n:
            raise ProtocolError("parameters.seed", f"has {len(seed)} seeds for {n} observations")
        for i, s in enumerate(seed):
            if not _is_int(s):
                raise ProtocolError(f"parameters.seed[{i}]", f"expected an integer, got {str(s)[:40]}")
            if not 0 <= s <= MAX_SEED:
                raise ProtocolError(f"parameters.seed[{i}]", f"must be in 0..2**63-1, got {s}")
        seeds = [int(s) for s in seed]
    else:
        raise ProtocolError("parameters.seed", f"expected an integer or a list of integers, got {str(seed)[:40]}")
    return out, seeds


# ------------------------------------------------------------------------------------------- request decode
def parse_request(body: dict[str, Any], limits: DecodeLimits | None = None) -> ActionRequest:
    """A decoded request body (decode_body's output) -> ActionRequest (Observations + seeds + parameters).
    `limits`: image pixel/decoded-byte caps and text lengths (default DecodeLimits()). Raises ProtocolError."""
    limits = limits or DecodeLimits()
    budget = ImageBudget(limits)
    _expect_mapping(body, "")
    _refuse_unknown(body, TOP_NAMES, "")
    rid_key = "request_id" if "request_id" in body else "id"
    rid = body.get(rid_key)
    if rid is not None and (not isinstance(rid, (str, int)) or isinstance(rid, bool)):
        raise ProtocolError(rid_key, f"expected a string, got {type(rid).__name__}")
    if isinstance(rid, str) and len(rid) > limits.max_text_chars:
        raise ProtocolError(rid_key, f"longer than {limits.max_text_chars} characters")
    rid = str(rid) if rid is not None else f"act_{uuid.uuid4().hex}"
    model = body.get("model")   # accepted as SGLang does, and not interpreted: the server answers with its own
    if model is not None and not isinstance(model, str):
        raise ProtocolError("model", f"expected a string, got {type(model).__name__}")
    if model is not None and len(model) > limits.max_text_chars:
        raise ProtocolError("model", f"longer than {limits.max_text_chars} characters")
    if "input" not in body:
        raise ProtocolError("input", "missing required field")
    inp = _expect_mapping(body["input"], "input")
    for k in _SGLANG_ONLY_INPUTS:
        if k in inp:
            raise ProtocolError(f"input.{k}", "not served here (send images inline)", status=422)
    _refuse_unknown(inp, INPUT_NAMES, "input")

    # images -> list of {camera: array}
    single = [k for k in ("image", "input_reference") if k in inp]
    if len(single) > 1:
        raise ProtocolError("input.input_reference", "send either input.image or input.input_reference, not both")
    if single and "images" in inp:
        raise ProtocolError("input.images", f"send either input.{single[0]} or input.images, not both")
    if single:
        key = single[0]
        frames = [{DEFAULT_CAMERA: a} for a in _decode_image_list(inp[key], f"input.{key}", budget)]
    elif "images" in inp:
        imgs = inp["images"]
        if isinstance(imgs, dict):
            imgs, path_of = [imgs], (lambda i: "input.images")
        elif isinstance(imgs, list):
            path_of = (lambda i: f"input.images[{i}]")
        else:
            raise ProtocolError("input.images", "expected {camera: image} or a list of them")
        if not imgs:
            raise ProtocolError("input.images", "empty list")
        check_count(len(imgs), limits, "input.images")
        frames = []
        for i, cams in enumerate(imgs):
            p = path_of(i)
            _expect_mapping(cams, p)
            if not cams:
                raise ProtocolError(p, "no cameras")
            fr = {}
            for cam, v in cams.items():
                if not isinstance(cam, str) or not cam:
                    raise ProtocolError(p, f"camera names must be non-empty strings, got {cam!r}")
                fr[cam] = decode_image(v, f"{p}.{cam}", budget=budget)
            frames.append(fr)
    else:
        raise ProtocolError("input.image", "missing required field (or input.images / input.input_reference)")
    n = len(frames)

    # prompts
    tkeys = [k for k in ("task", "prompt") if k in inp]
    if len(tkeys) > 1:
        raise ProtocolError("input.prompt", "send either input.task or input.prompt, not both")
    tasks = [""] * n
    if tkeys:
        tk = tkeys[0]
        t, is_list = _list_or_one(inp[tk])
        for i, s in enumerate(t):
            where = f"input.{tk}[{i}]" if is_list else f"input.{tk}"
            if not isinstance(s, str):
                raise ProtocolError(where, "expected a string")
            if len(s) > limits.max_text_chars:
                raise ProtocolError(where, f"longer than {limits.max_text_chars} characters")
        if len(t) == 1:
            tasks = t * n
        elif len(t) == n:
            tasks = t
        else:
            raise ProtocolError(f"input.{tk}", f"has {len(t)} prompts for {n} observations")

    states: list[np.ndarray | None] = [None] * n
    if inp.get("state") is not None:
        states = _decode_states(inp["state"], n, "input.state")

    params, seeds = _validate_parameters(_expect_mapping(body.get("parameters") or {}, "parameters"), n, limits)

    rt = _expect_mapping(body.get("runtime") or {}, "runtime")
    _refuse_unknown(rt, RUNTIME_NAMES, "runtime")
    runtime = Runtime()
    rf = rt.get("response_format", "envelope")
    if rf != "envelope":
        raise ProtocolError("runtime.response_format", f"only 'envelope' is served here, got {rf!r}", status=422)
    of = rt.get("output_format", params.pop("output_format", None))
    if of is not None and of not in ("list", "numpy"):
        raise ProtocolError("runtime.output_format", f"must be 'list' or 'numpy', got {of!r}")
    runtime.output_format = of
    rtm = rt.get("return_timing", body.get("return_timing", True))
    runtime.return_timing = bool(rtm) if not isinstance(rtm, str) else rtm.lower() not in ("false", "0", "no")

    obs = [Observation(images=frames[i], state=states[i], task=tasks[i]) for i in range(n)]
    return ActionRequest(request_id=rid, observations=obs, seeds=seeds, parameters=params, runtime=runtime)


# ------------------------------------------------------------------------------------------- request encode
def _encode_state(s: np.ndarray, binary: bool) -> Any:
    s = np.ascontiguousarray(s, np.float32)
    if binary:
        return {"dtype": "float32", "shape": list(s.shape), "bytes": s.tobytes()}
    return s.tolist()


def build_request(observations: Sequence[Observation], seeds: Sequence[int] | int | None = None,
                  parameters: dict[str, Any] | None = None, request_id: str | None = None,
                  binary: bool = True, image_encoding: str | None = None) -> dict[str, Any]:
    """Observations -> request body (wamkit server). binary=True: msgpack-ready raw arrays; False: JSON-ready
    (PNG base64 images unless image_encoding says otherwise). One camera named "image" -> SGLang's `input.image`;
    otherwise `input.images` (one {camera: image} per observation)."""
    if not observations:
        raise ValueError("build_request needs at least one observation")
    enc = image_encoding or ("raw" if binary else "png")
    n = len(observations)
    inp: dict[str, Any] = {}
    if all(list(o.images) == [DEFAULT_CAMERA] for o in observations):
        inp["image"] = [encode_image(o.images[DEFAULT_CAMERA], enc) for o in observations]
    else:
        inp["images"] = [{c: encode_image(a, enc) for c, a in o.images.items()} for o in observations]
    tasks = [o.task for o in observations]
    inp["task"] = tasks[0] if len(set(tasks)) == 1 else tasks
    if any(o.state is not None for o in observations):
        if not all(o.state is not None for o in observations):
            raise ValueError("either every observation has a state or none has")
        inp["state"] = [_encode_state(o.state, binary) for o in observations]
    params = dict(parameters or {})
    if seeds is not None:
        if isinstance(seeds, (int, np.integer)):
            params["seed"] = int(seeds)
        else:
            if len(seeds) != n:
                raise ValueError(f"{len(seeds)} seeds for {n} observations")
            params["seed"] = [int(s) for s in seeds]
    return {"request_id": request_id or f"req_{uuid.uuid4().hex[:16]}", "input": inp, "parameters": params,
            "runtime": {"response_format": "envelope", "output_format": "numpy" if binary else "list"}}


# ------------------------------------------------------------------------------------------ response encode
def _encode_values(a: np.ndarray, numpy_out: bool) -> Any:
    a = np.ascontiguousarray(a, np.float32)
    if numpy_out:  # SGLang's msgpack array marker: SGLang clients decode it as is
        return {"__ndarray__": True, "data": a.tobytes(), "dtype": a.dtype.str, "shape": list(a.shape)}
    return a.tolist()


def build_response(request: ActionRequest, actions: np.ndarray, model: str, binary: bool,
                   timing: dict[str, Any] | None = None, denoise_steps: int | None = None) -> dict[str, Any]:
    """(N, H, D) actions for `request` -> envelope. Applies action_horizon / raw_action_dim (first channels)."""
    actions = np.asarray(actions, np.float32)
    p = request.parameters
    if p.get("action_horizon"):
        actions = actions[:, : p["action_horizon"]]
    if p.get("raw_action_dim"):
        actions = actions[:, :, : p["raw_action_dim"]]
    of = request.runtime.output_format or ("numpy" if binary else "list")
    numpy_out = binary and of == "numpy"
    h, d = int(actions.shape[1]), int(actions.shape[2])
    data = []
    for i in range(actions.shape[0]):
        act = {"type": "continuous", "dtype": "float32", "shape": [h, d], "values": _encode_values(actions[i], numpy_out),
               "action_mode": p.get("action_mode", "policy"), "raw_action_dim": d}
        if p.get("domain_id") is not None:
            act["domain_id"] = p["domain_id"]
        data.append({"index": i, "input_index": i, "candidate_index": 0, "action": act})
    body = {"id": request.request_id, "object": OBJECT, "created": int(time.time()), "model": model, "data": data,
            "usage": {"batch_size": len(data), "action_horizon": h, "action_dim": d,
                      "denoise_steps": denoise_steps if denoise_steps is not None
                      else p.get("num_inference_steps", 0)}}
    if timing is not None and request.runtime.return_timing:
        body["timing"] = timing
    return body


# ------------------------------------------------------------------------------------------ response decode
def decode_action_values(values: Any, path: str, shape: Any = None) -> np.ndarray:
    """Action values in any form a server sends (lists, SGLang's ndarray marker, raw/values dicts) -> float32."""
    arr = _decode_float_array(values, path)
    if shape is not None:
        try:
            arr = arr.reshape([int(s) for s in shape])
        except (ValueError, TypeError):
            raise ProtocolError(path, f"{arr.size} values do not match shape {shape!r}") from None
    if arr.ndim != 2:
        raise ProtocolError(path, f"expected an (H, D) action chunk, got shape {list(arr.shape)}")
    return arr


def parse_response(body: dict[str, Any], raw_action_dim: int | None = None, expect_n: int | None = None
                   ) -> ActionResponse:
    """Envelope -> ActionResponse: actions sorted by input_index (candidate 0), first raw_action_dim channels
    (the argument, else each item's action.raw_action_dim)."""
    _expect_mapping(body, "")
    if body.get("object", OBJECT) != OBJECT:
        raise ProtocolError("object", f"expected {OBJECT!r}, got {body.get('object')!r}")
    data = body.get("data")
    if not isinstance(data, list) or not data:
        raise ProtocolError("data", "expected a non-empty list")
    chunks: dict[int, np.ndarray] = {}
    for j, item in enumerate(data):
        p = f"data[{j}]"
        _expect_mapping(item, p)
        if item.get("candidate_index", 0) != 0:
            continue
        idx = item.get("input_index", item.get("index"))
        if not _is_int(idx):
            raise ProtocolError(p + ".input_index", f"expected an integer, got {idx!r}")
        act = _expect_mapping(item.get("action"), p + ".action")
        if "values" not in act:
            raise ProtocolError(p + ".action.values", "missing required field")
        a = decode_action_values(act["values"], p + ".action.values", act.get("shape"))
        rd = raw_action_dim or act.get("raw_action_dim")
        if rd:
            if int(rd) > a.shape[1]:
                raise ProtocolError(p + ".action.raw_action_dim", f"{rd} > {a.shape[1]} channels sent")
            a = a[:, : int(rd)]
        if int(idx) in chunks:
            raise ProtocolError(p + ".input_index", f"duplicate input_index {idx}")
        chunks[int(idx)] = a
    order = sorted(chunks)
    if order != list(range(len(order))):
        raise ProtocolError("data", f"input_index values are not 0..N-1: {order}")
    if expect_n is not None and len(order) != expect_n:
        raise ProtocolError("data", f"got {len(order)} action chunks for {expect_n} observations")
    shapes = {chunks[i].shape for i in order}
    if len(shapes) != 1:
        raise ProtocolError("data", f"action chunks of different shapes: {sorted(shapes)}")
    actions = np.stack([chunks[i] for i in order]).astype(np.float32, copy=False)
    timing = body.get("timing") if isinstance(body.get("timing"), dict) else None
    return ActionResponse(id=str(body.get("id", "")), model=str(body.get("model", "")), actions=actions,
                          usage=dict(body.get("usage") or {}), timing=timing, body=body)
