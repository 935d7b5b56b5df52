"""Typed messages of ``POST /v1/actions/generations`` (SGLang's action API) plus wamkit's extensions.

Request (SGLang's fields; wamkit extensions marked +)::

    {"request_id": str,
     "input": {"task" | "prompt": str | [str] * N,
               "image" | "input_reference": image | [image] * N | [N, H, W, 3],   # camera "image"
               "images": {camera: image | [image] * N | [N, H, W, 3]}             # every camera the same N
                         | + [{camera: image, ...}] * N,
               "state": [float] | + [[float]] * N,                                # proprio, one per observation
               "observation": {the fields above, "observation.images.<camera>", "observation.state"}},
     "parameters": {"action_mode": "policy", "domain_name", "raw_action_dim", "action_horizon", "num_frames",
                    "num_inference_steps", "guidance_scale", "seed": int | + [int] * N, "fps", "height", "width", ...},
     "runtime": {"response_format": "envelope" | "raw", "output_format": "list" | "numpy"}}

As SGLang reads it: `input.observation` is the base and `input.task/prompt/image/images/state` override it; without
`action_horizon`, `num_frames` gives it (num_frames - 1); integer parameters and the seed may be integral floats or
text ("7"), as SGLang's Cosmos3 path reads them (int(...)); `action_mode` and the runtime formats are read case-insensitively; no seed means DEFAULT_SEED (42).

Response (envelope)::

    {"id", "object": "action.generation", "created", "model",
     "data": [{"index", "input_index", "candidate_index", "action": {"type", "dtype", "shape", "values",
                                                                     "action_mode", "domain_id", "raw_action_dim"}}],
     "usage": {"batch_size", "action_horizon", "action_dim", "denoise_steps", "prefix_cache_hit"},
     "timings": {"queue_ms", "compute_ms"},
     + "timing": {"queue_ms", "compute_ms", "batch_size", "batches", "t_start", "t_end"}}

Validation errors raise ProtocolError naming the field path (``input.image[3].shape``). Unknown fields are refused
(a typo must not silently change behaviour); SGLang parameters wamkit does not interpret are accepted, passed to the
batch grouping key, and otherwise ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from wamkit.core.types import Observation
from wamkit.protocol.errors import ProtocolError
from wamkit.protocol.images import decode_image, encode_image
from wamkit.protocol.limits import MAX_DIM, DecodeLimits, ImageBudget, check_count, parse_dtype

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
_SGLANG_ONLY_INPUTS = ("image_path", "video", "video_path", "noise")   # SGLang reads them; 422 here
SG_IMAGE_PREFIX = "observation.images."  # SGLang / LeRobot spelling of a camera key (input.observation, openpi frames)


# ----------------------------------------------------------------------------------------------------- messages
@dataclass
class Runtime:
    response_format: str = "envelope"     # or "raw": SGLang's pipeline output (build_raw_response)
    output_format: str | None = None      # None: "numpy" for msgpack responses, "list" for JSON (as SGLang)
    return_timing: bool = True


@dataclass
class ActionRequest:
    request_id: str
    observations: list[Observation]
    seeds: list[int]
    parameters: dict[str, Any]            # validated SGLang parameters, without "seed"
    runtime: Runtime = field(default_factory=Runtime)
    horizon_source: str = "action_horizon"   # the parameter action_horizon came from ("num_frames": derived)

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
            dt = parse_dtype(dtype or "float32")
        except ValueError:
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
DEFAULT_SEED = 42        # the seed of a request that sends none (SGLang's default: same actions from either server)
_INT_TEXT = re.compile(r"\s*[+-]?\d{1,20}\s*")
_FLOAT_TEXT = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _field(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def as_int(v: Any, path: str) -> int:
    """An integer as SGLang's int(...) takes it: an int, an integral float (7.0) or integral text ("7"); not a
    bool, 7.5 or "7.5" (SGLang's int() would truncate 7.5 to 7, and refuses "7.5": both refused here, naming the
    field)."""
    if _is_int(v):
        return int(v)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if isinstance(v, str) and _INT_TEXT.fullmatch(v):
        return int(v)
    raise ProtocolError(path, f"expected an integer, got {str(v)[:40]!r}")


def _as_float(v: Any, path: str) -> float:
    """A number, or numeric text ("1.5", as SGLang's float(...) takes it); finite."""
    if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
        out = float(v)
    elif isinstance(v, str) and _FLOAT_TEXT.fullmatch(v):
        out = float(v)
    else:
        raise ProtocolError(path, f"expected a number, got {str(v)[:40]!r}")
    if not math.isfinite(out):
        raise ProtocolError(path, f"must be finite, got {str(v)[:40]!r}")
    return out


def _int_param(k: str, v: Any, path: str) -> int:
    v = as_int(v, path)
    if k != "domain_id" and v <= 0:
        raise ProtocolError(path, f"must be positive, got {v}")
    if abs(v) > _MAX_PARAM_INT:
        raise ProtocolError(path, f"must be at most {_MAX_PARAM_INT} in magnitude, got {v}")
    return v


def _str_param(k: str, v: Any, path: str, limits: DecodeLimits) -> str:
    if not isinstance(v, str):
        raise ProtocolError(path, f"expected a string, got {str(v)[:40]}")
    if len(v) > limits.max_text_chars:
        raise ProtocolError(path, f"longer than {limits.max_text_chars} characters")
    return v.strip().lower() if k in ("action_mode", "output_format") else v   # as SGLang reads them


def _any_param(v: Any, path: str, limits: DecodeLimits) -> Any:
    """_ANY_PARAMS: a scalar or a flat list of scalars, kept small."""
    if isinstance(v, (dict, list)):
        if isinstance(v, dict) or len(v) > limits.max_param_items or \
                any(isinstance(x, (dict, list, bytes)) for x in v):
            raise ProtocolError(path, f"expected a scalar or a flat list of at most {limits.max_param_items} "
                                      f"scalars")
    elif isinstance(v, (str, bytes)) and len(v) > limits.max_text_chars:
        raise ProtocolError(path, f"longer than {limits.max_text_chars} characters")
    return v


def _param_value(k: str, v: Any, path: str, limits: DecodeLimits) -> Any:
    if k in _INT_PARAMS:
        return _int_param(k, v, path)
    if k in _FLOAT_PARAMS:
        return _as_float(v, path)
    if k in _STR_PARAMS:
        return _str_param(k, v, path, limits)
    return _any_param(v, path, limits)


def _check_modes(out: dict[str, Any], prefix: str) -> None:
    mode = out.get("action_mode", "policy")
    if mode != "policy":
        raise ProtocolError(_field(prefix, "action_mode"), f"only 'policy' is served here, got {mode!r}", status=422)
    if out.get("candidate_count", 1) > 1:
        raise ProtocolError(_field(prefix, "candidate_count"), "several candidates per observation are not served "
                                                               "here", status=422)


def _horizon(out: dict[str, Any], prefix: str) -> str:
    """action_horizon from num_frames when only that is sent (num_frames = action_horizon + 1, as SGLang's Cosmos3
    derives it); num_frames is then dropped (it says nothing more). Returns the field the horizon came from."""
    h, nf = out.get("action_horizon"), out.pop("num_frames", None)
    if nf is None:
        return "action_horizon"
    if h is not None:
        if nf != h + 1:
            raise ProtocolError(_field(prefix, "num_frames"), f"must equal action_horizon + 1 ({h + 1}), got {nf}")
        return "action_horizon"
    if nf < 2:
        raise ProtocolError(_field(prefix, "num_frames"), f"must be at least 2 (action_horizon = num_frames - 1), "
                                                          f"got {nf}")
    out["action_horizon"] = nf - 1
    return "num_frames"


def _one_seed(s: Any, path: str) -> int:
    s = as_int(s, path)
    if not 0 <= s <= MAX_SEED:
        raise ProtocolError(path, f"must be in 0..2**63-1, got {s}")
    return s


def parse_seeds(seed: Any, n: int, path: str = "parameters.seed") -> list[int]:
    """`seed`: one integer for all n observations (DEFAULT_SEED when absent/None) or (wamkit) a list of n."""
    if seed is None:
        return [DEFAULT_SEED] * n
    if isinstance(seed, list):
        if len(seed) != n:
            raise ProtocolError(path, f"has {len(seed)} seeds for {n} observations")
        return [_one_seed(s, f"{path}[{i}]") for i, s in enumerate(seed)]
    if isinstance(seed, (dict, bytes, bool)):
        raise ProtocolError(path, f"expected an integer or a list of integers, got {str(seed)[:40]}")
    return [_one_seed(seed, path)] * n


def validate_parameters(params: dict, n: int, limits: DecodeLimits, prefix: str = "parameters"
                        ) -> tuple[dict[str, Any], list[int], str]:
    """SGLang's parameters -> (validated parameters without seed, one seed per observation, the field the horizon
    came from). prefix: the path of the mapping in error messages ("" for openpi frames, whose keys are top-level)."""
    _refuse_unknown(params, PARAMETER_NAMES, prefix)
    out = {k: _param_value(k, v, _field(prefix, k), limits) for k, v in params.items()
           if k != "seed" and v is not None}
    _check_modes(out, prefix)
    source = _horizon(out, prefix)
    return out, parse_seeds(params.get("seed"), n, _field(prefix, "seed")), source


# ------------------------------------------------------------------------------------------- request decode
class _Input:
    """The fields of one request's observations, each with the path it came from: `single` (input.image or
    input.input_reference), `cameras` ({camera: (value, path)}: input.images as a mapping, or input.observation's
    cameras), `images_list` (wamkit's list of {camera: image}), `task` and `state`."""

    def __init__(self) -> None:
        self.single: tuple[str, Any, str] | None = None      # (field name, value, path)
        self.cameras: dict[str, tuple[Any, str]] | None = None
        self.images_list: tuple[Any, str] | None = None
        self.task: tuple[str, Any, str] | None = None         # (field name, value, path)
        self.state: tuple[Any, str] | None = None
        self.prefixed: dict[str, tuple[Any, str]] = {}       # input.observation's observation.images.<camera>


def _refuse_sglang_only(d: dict, path: str) -> None:
    for k in _SGLANG_ONLY_INPUTS:
        if k in d:
            raise ProtocolError(_field(path, k), "not served here (send images inline)", status=422)


def _read_images(inp: _Input, value: Any, path: str) -> None:
    if isinstance(value, dict):
        inp.cameras, inp.images_list = {k: (v, f"{path}.{k}") for k, v in value.items()}, None
    elif isinstance(value, list):
        inp.cameras, inp.images_list = None, (value, path)
    else:
        raise ProtocolError(path, "expected {camera: image(s)} or a list of {camera: image}")


def _read_fields(inp: _Input, d: dict, path: str) -> None:
    """input's (or input.observation's) fields into `inp`, later ones replacing earlier ones (SGLang: input.*
    overrides input.observation.*)."""
    tkeys = [k for k in ("task", "prompt") if k in d]
    if len(tkeys) > 1:
        raise ProtocolError(f"{path}.prompt", f"send either {path}.task or {path}.prompt, not both")
    if tkeys:
        inp.task = (tkeys[0], d[tkeys[0]], f"{path}.{tkeys[0]}")
    single = [k for k in ("image", "input_reference") if k in d]
    if len(single) > 1:
        raise ProtocolError(f"{path}.input_reference", f"send either {path}.image or {path}.input_reference, "
                                                       f"not both")
    if single:
        inp.single = (single[0], d[single[0]], f"{path}.{single[0]}")
    if "images" in d:
        _read_images(inp, d["images"], f"{path}.images")
    if d.get("state") is not None:
        inp.state = (d["state"], f"{path}.state")


def _read_observation(inp: _Input, obs: Any, path: str) -> None:
    """SGLang's input.observation: its images/state/prompt fields, plus LeRobot's `observation.images.<camera>` and
    `observation.state` keys."""
    obs = _expect_mapping(obs if obs is not None else {}, path)
    for k in obs:
        if isinstance(k, str) and k.removeprefix("observation.") in _SGLANG_ONLY_INPUTS:
            raise ProtocolError(f"{path}.{k}", "not served here (send images inline)", status=422)
    plain = {}
    cams: dict[str, tuple[Any, str]] = {}
    for k, v in obs.items():
        if isinstance(k, str) and k.startswith(SG_IMAGE_PREFIX) and len(k) > len(SG_IMAGE_PREFIX):
            cams[k[len(SG_IMAGE_PREFIX):]] = (v, f"{path}.{k}")
        elif k == "observation.state":
            if obs.get("state") is not None:
                raise ProtocolError(f"{path}.observation.state", f"send either {path}.state or "
                                                                 f"{path}.observation.state, not both")
            plain["state"] = v
        elif k in INPUT_NAMES:
            plain[k] = v
        else:
            raise ProtocolError(f"{path}.{k}", f"unknown field; valid fields: {', '.join(sorted(INPUT_NAMES))}, "
                                               f"observation.images.<camera>, observation.state")
    _read_fields(inp, plain, path)
    inp.prefixed = cams   # kept apart: as SGLang, an input.images replaces the observation's images, not these


def _collect_input(inp_body: dict) -> _Input:
    _refuse_sglang_only(inp_body, "input")
    _refuse_unknown(inp_body, INPUT_NAMES | {"observation"}, "input")
    inp = _Input()
    if "observation" in inp_body:
        _read_observation(inp, inp_body["observation"], "input.observation")
    top = _Input()
    _read_fields(top, inp_body, "input")
    for name in ("task", "state"):
        if getattr(top, name) is not None:
            setattr(inp, name, getattr(top, name))
    if top.single is not None or top.cameras is not None or top.images_list is not None:
        if top.single is not None:
            inp.single = top.single
        if top.cameras is not None or top.images_list is not None:
            inp.cameras, inp.images_list = top.cameras, top.images_list
    if inp.prefixed:   # observation.images.<camera> join the images (and win over a camera of the same name)
        if inp.images_list is not None:
            raise ProtocolError(inp.images_list[1], "a list of {camera: image} cannot be combined with "
                                                    "input.observation's observation.images.<camera> keys")
        inp.cameras = {**(inp.cameras or {}), **inp.prefixed}
    return inp


def _camera_frames(cameras: dict[str, tuple[Any, str]], path: str, budget: ImageBudget) -> list[dict]:
    """{camera: one image, or a list / [N, H, W, 3] batch} -> N frames; every camera must hold the same N."""
    if not cameras:
        raise ProtocolError(path, "no cameras")
    per_cam: dict[str, list[np.ndarray]] = {}
    for cam, (v, p) in cameras.items():
        if not isinstance(cam, str) or not cam:
            raise ProtocolError(path, f"camera names must be non-empty strings, got {cam!r}")
        per_cam[cam] = _decode_image_list(v, p, budget)
    counts = {cam: len(a) for cam, a in per_cam.items()}
    if len(set(counts.values())) > 1:
        raise ProtocolError(path, f"cameras hold different numbers of images: {counts}")
    n = next(iter(counts.values()))
    return [{cam: a[i] for cam, a in per_cam.items()} for i in range(n)]


def _list_frames(imgs: list, path: str, limits: DecodeLimits, budget: ImageBudget) -> list[dict]:
    """wamkit's list form: [{camera: image}, ...], one mapping per observation."""
    if not imgs:
        raise ProtocolError(path, "empty list")
    check_count(len(imgs), limits, path)
    frames = []
    for i, cams in enumerate(imgs):
        p = f"{path}[{i}]"
        _expect_mapping(cams, p)
        if not cams:
            raise ProtocolError(p, "no cameras")
        fr = {}
        for cam, v in cams.items():
            if not isinstance(cam, str) or not cam:
                raise ProtocolError(p, f"camera names must be non-empty strings, got {cam!r}")
            fr[cam] = decode_image(v, f"{p}.{cam}", budget=budget)
        frames.append(fr)
    return frames


def _decode_frames(inp: _Input, limits: DecodeLimits, budget: ImageBudget) -> list[dict]:
    has_images = inp.cameras is not None or inp.images_list is not None
    if inp.single is not None and has_images:
        where = inp.images_list[1] if inp.images_list is not None else next(iter(inp.cameras.values()))[1]
        raise ProtocolError(where, f"send either input.{inp.single[0]} or cameras by name ({where}), not both")
    if inp.single is not None:
        name, value, path = inp.single
        return [{DEFAULT_CAMERA: a} for a in _decode_image_list(value, path, budget)]
    if inp.images_list is not None:
        return _list_frames(inp.images_list[0], inp.images_list[1], limits, budget)
    if inp.cameras is not None:
        return _camera_frames(inp.cameras, "input.images", budget)
    raise ProtocolError("input.image", "missing required field (or input.images / input.input_reference)")


def _decode_tasks(task: tuple[str, Any, str] | None, n: int, limits: DecodeLimits) -> list[str]:
    if task is None:
        return [""] * n
    _, value, path = task
    t, is_list = _list_or_one(value)
    for i, s in enumerate(t):
        where = f"{path}[{i}]" if is_list else path
        if not isinstance(s, str):
            raise ProtocolError(where, "expected a string")
        if len(s) > limits.max_text_chars:
            raise ProtocolError(where, f"longer than {limits.max_text_chars} characters")
    if len(t) == 1:
        return t * n
    if len(t) != n:
        raise ProtocolError(path, f"has {len(t)} prompts for {n} observations")
    return t


def _request_id(body: dict, limits: DecodeLimits) -> str:
    rid_key = "request_id" if "request_id" in body else "id"
    rid = body.get(rid_key)
    if rid is not None and (not isinstance(rid, (str, int)) or isinstance(rid, bool)):
        raise ProtocolError(rid_key, f"expected a string, got {type(rid).__name__}")
    if isinstance(rid, str) and len(rid) > limits.max_text_chars:
        raise ProtocolError(rid_key, f"longer than {limits.max_text_chars} characters")
    return str(rid) if rid is not None else f"act_{uuid.uuid4().hex}"


def _check_model(body: dict, limits: DecodeLimits) -> None:
    model = body.get("model")   # accepted as SGLang does, and not interpreted: the server answers with its own
    if model is not None and not isinstance(model, str):
        raise ProtocolError("model", f"expected a string, got {type(model).__name__}")
    if model is not None and len(model) > limits.max_text_chars:
        raise ProtocolError("model", f"longer than {limits.max_text_chars} characters")


def _runtime_text(rt: dict, key: str, default: Any) -> Any:
    v = rt.get(key, default)
    return v.strip().lower() if isinstance(v, str) else v   # SGLang lower-cases both formats


def _parse_runtime(body: dict, params: dict[str, Any]) -> Runtime:
    rt = _expect_mapping(body.get("runtime") or {}, "runtime")
    _refuse_unknown(rt, RUNTIME_NAMES, "runtime")
    runtime = Runtime()
    rf = _runtime_text(rt, "response_format", "envelope")
    if rf not in ("envelope", "raw"):
        raise ProtocolError("runtime.response_format", f"must be 'envelope' or 'raw', got {rf!r}")
    runtime.response_format = rf
    of = _runtime_text(rt, "output_format", params.pop("output_format", None))
    if of is not None and of not in ("list", "numpy"):
        raise ProtocolError("runtime.output_format", f"must be 'list' or 'numpy', got {of!r}")
    runtime.output_format = of
    rtm = rt.get("return_timing", body.get("return_timing", True))
    runtime.return_timing = bool(rtm) if not isinstance(rtm, str) else rtm.lower() not in ("false", "0", "no")
    return runtime


def parse_request(body: dict[str, Any], limits: DecodeLimits | None = None,
                  budget: ImageBudget | None = None) -> ActionRequest:
    """A decoded request body (decode_body's output) -> ActionRequest (Observations + seeds + parameters).
    `limits`: image pixel/decoded-byte caps and text lengths (default DecodeLimits()); `budget`: the request's image
    budget (default: a fresh one of `limits`). Raises ProtocolError."""
    limits = limits or DecodeLimits()
    _expect_mapping(body, "")
    _refuse_unknown(body, TOP_NAMES, "")
    rid = _request_id(body, limits)
    _check_model(body, limits)
    if "input" not in body:
        raise ProtocolError("input", "missing required field")
    inp = _collect_input(_expect_mapping(body["input"], "input"))
    frames = _decode_frames(inp, limits, budget or ImageBudget(limits))
    n = len(frames)
    tasks = _decode_tasks(inp.task, n, limits)
    states: list[np.ndarray | None] = [None] * n
    if inp.state is not None:
        states = _decode_states(inp.state[0], n, inp.state[1])
    params, seeds, source = validate_parameters(_expect_mapping(body.get("parameters") or {}, "parameters"), n,
                                                limits)
    runtime = _parse_runtime(body, params)
    obs = [Observation(images=frames[i], state=states[i], task=tasks[i]) for i in range(n)]
    return ActionRequest(request_id=rid, observations=obs, seeds=seeds, parameters=params, runtime=runtime,
                         horizon_source=source)


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
    if numpy_out:  # SGLang's msgpack array marker, keys packed as bytes as SGLang packs them (what openpi's
        # msgpack_numpy.unpackb and SGLang's own unpacker turn into an ndarray)
        return {b"__ndarray__": True, b"data": a.tobytes(), b"dtype": a.dtype.str, b"shape": list(a.shape)}
    return a.tolist()


def _cut(request: ActionRequest, actions: np.ndarray) -> np.ndarray:
    """(N, H, D) actions -> the first action_horizon steps and raw_action_dim channels the request asks for."""
    actions = np.asarray(actions, np.float32)
    p = request.parameters
    if p.get("action_horizon"):
        actions = actions[:, : p["action_horizon"]]
    if p.get("raw_action_dim"):
        actions = actions[:, :, : p["raw_action_dim"]]
    return actions


def _numpy_out(request: ActionRequest, binary: bool) -> bool:
    return binary and (request.runtime.output_format or ("numpy" if binary else "list")) == "numpy"


def _stage_timings(timing: dict[str, Any]) -> dict[str, float]:
    """SGLang's `timings` (milliseconds per stage) from wamkit's `timing`."""
    return {k: float(timing[k]) for k in ("queue_ms", "compute_ms") if k in timing}


def build_response(request: ActionRequest, actions: np.ndarray, model: str, binary: bool,
                   timing: dict[str, Any] | None = None, denoise_steps: int | None = None) -> dict[str, Any]:
    """(N, H, D) actions for `request` -> envelope. Applies action_horizon / raw_action_dim (first channels).
    denoise_steps: what usage reports (default: the request's num_inference_steps, else 0)."""
    actions = _cut(request, actions)
    p = request.parameters
    numpy_out = _numpy_out(request, binary)
    h, d = int(actions.shape[1]), int(actions.shape[2])
    data = []
    for i in range(actions.shape[0]):
        act = {"type": "continuous", "dtype": "float32", "shape": [h, d],
               "values": _encode_values(actions[i], numpy_out), "action_mode": p.get("action_mode", "policy"),
               "raw_action_dim": d}
        if p.get("domain_id") is not None:
            act["domain_id"] = p["domain_id"]
        data.append({"index": i, "input_index": i, "candidate_index": 0, "action": act})
    steps = denoise_steps if denoise_steps is not None else p.get("num_inference_steps", 0)
    body = {"id": request.request_id, "object": OBJECT, "created": int(time.time()), "model": model, "data": data,
            "usage": {"batch_size": len(data), "action_horizon": h, "action_dim": d, "denoise_steps": steps,
                      "prefix_cache_hit": False}}
    if timing is not None and request.runtime.return_timing:
        body["timing"] = timing
        body["timings"] = _stage_timings(timing)
    return body


def build_raw_response(request: ActionRequest, actions: np.ndarray, binary: bool,
                       timing: dict[str, Any] | None = None, denoise_steps: int | None = None) -> dict[str, Any]:
    """`runtime.response_format: "raw"`: SGLang's pipeline output as it is, ``{"request_id", "actions": (H, D) for
    one observation or (N, H, D), "action_mode", "raw_action_dim", "domain_id" (when the request gave one),
    "parameters": {"num_inference_steps"}, "timings"}``; values as in the envelope (array marker or lists)."""
    actions = _cut(request, actions)
    p = request.parameters
    steps = denoise_steps if denoise_steps is not None else p.get("num_inference_steps", 0)
    out = {"request_id": request.request_id,
           "actions": _encode_values(actions[0] if len(actions) == 1 else actions, _numpy_out(request, binary)),
           "action_mode": p.get("action_mode", "policy"), "raw_action_dim": int(actions.shape[2]),
           "parameters": {"num_inference_steps": steps}}
    if p.get("domain_id") is not None:
        out["domain_id"] = p["domain_id"]
    if timing is not None and request.runtime.return_timing:
        out["timings"] = _stage_timings(timing)
    return out


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
