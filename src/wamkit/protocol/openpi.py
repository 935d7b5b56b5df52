"""Frames of openpi's websocket policy protocol and of SGLang's realtime action websocket (same transport).

Transport: one websocket; every frame is binary msgpack in which numpy arrays travel as openpi's msgpack-numpy
marker ``{b"__ndarray__": True, b"data": <raw bytes>, b"dtype": "<f4", b"shape": [...]}`` (keys packed as bytes).
1. server -> client, once, right after the handshake: the metadata frame (a mapping).
2. client -> server: one request per frame; server -> client: one reply per frame, in order.

Request forms (both accepted on every route):
- observation dict (openpi): the keys openpi's LIBERO example sends,
  ``{"observation/image": uint8 (H, W, 3), "observation/wrist_image": uint8 (H, W, 3),
  "observation/state": float (S,), "prompt": str}``: ``observation/<camera>`` is camera ``<camera>``,
  ``observation/state`` the state; also SGLang's spellings (``images: {camera: image}``, ``image``,
  ``observation.images.<camera>``, ``state``, ``observation.state``, ``task``), ``seed`` (int, default 42, SGLang's)
  and SGLang's parameters, which SGLang reads from the frame itself (``action_horizon``, ``num_frames``,
  ``num_inference_steps``, ``guidance_scale``, ...: any `parameters` name, validated as over HTTP).
- action request (SGLang): ``{"input": {...}, "parameters": {...}, ...}`` exactly as ``POST /v1/actions/generations``
  (several observations per frame where the server's metadata says ``capabilities.batch_inputs``).

Replies: openpi's ``{"actions": float32 (H, D), "server_timing": {"infer_ms", "prev_total_ms"}}`` (an (N, H, D) array
for an action request), or SGLang's envelope (``data[i].action.values`` as arrays) plus ``server_timing``.
openpi's control frames ``{"__ctrl__": "episode_start" | "episode_end", ...}`` are acknowledged with
``{"__ack__": <ctrl>}``. Unpacking never builds arrays from a marker by itself: images and states are validated
(dtype, shape, byte length) by the same decoders as the HTTP API, so an object dtype can never be materialised.
"""

from __future__ import annotations

import uuid
from typing import Any, Sequence

import msgpack
import numpy as np

from wamkit.core.types import Observation
from wamkit.protocol.codec import MSGPACK, decode_body
from wamkit.protocol.errors import ProtocolError
from wamkit.protocol.images import decode_image
from wamkit.protocol.limits import DecodeLimits, ImageBudget
from wamkit.protocol.messages import (_SGLANG_ONLY_INPUTS, DEFAULT_CAMERA, PARAMETER_NAMES, SG_IMAGE_PREFIX,
                                      ActionRequest, _decode_float_array, decode_action_values, validate_parameters)

OBS_PREFIX = "observation/"              # openpi: observation/<camera> and observation/state
STATE_KEYS = ("observation/state", "observation.state", "state")
PROMPT_KEYS = ("prompt", "task")
# SGLang's runtime knobs, read from a frame by SGLang, with one meaning here (arrays are always sent as arrays)
IGNORED_KEYS = frozenset(("output_format", "return_timing", "enable_prefix_cache", "enable_pi_prefix_cache",
                          "enable_cuda_graph", "enable_pi_cuda_graph"))
FRAME_PARAMETERS = PARAMETER_NAMES - IGNORED_KEYS   # seed, action_horizon, num_inference_steps, guidance_scale, ...


# ------------------------------------------------------------------------------------------------ msgpack-numpy
def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"arrays of dtype {obj.dtype} are not sent")
        a = np.ascontiguousarray(obj)
        return {b"__ndarray__": True, b"data": a.tobytes(), b"dtype": a.dtype.str, b"shape": list(a.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def packb(obj: Any) -> bytes:
    """msgpack with numpy arrays as openpi's msgpack-numpy marker (what openpi_client.msgpack_numpy.unpackb reads)."""
    return msgpack.packb(obj, use_bin_type=True, default=_pack_default)


def unpackb(data: bytes, max_depth: int = DecodeLimits.max_depth,
            max_containers: int = DecodeLimits.max_containers) -> dict[str, Any]:
    """A frame -> mapping; array markers stay mappings (decoded, with validation, by the field decoders). Refuses
    msgpack extension types, non-mapping frames, nesting deeper than max_depth and more than max_containers
    mappings/lists (ProtocolError)."""
    return decode_body(data, MSGPACK, max_depth, max_containers)


def bytes_keyed_marker(values: dict[str, Any]) -> dict[bytes, Any]:
    """wamkit's str-keyed ndarray marker -> openpi's bytes-keyed one (openpi's unpacker only looks for bytes keys)."""
    return {k.encode() if isinstance(k, str) else k: v for k, v in values.items()}


# ------------------------------------------------------------------------------------------------ observations
def observation_to_openpi(obs: Observation, seed: int | None = None) -> dict[str, Any]:
    """wamkit Observation -> openpi observation dict: camera c -> ``observation/c`` (LIBERO: image, wrist_image),
    state -> ``observation/state``, task -> ``prompt``; ``seed`` when given (wamkit and SGLang servers read it)."""
    d: dict[str, Any] = {OBS_PREFIX + cam: np.ascontiguousarray(img) for cam, img in obs.images.items()}
    if obs.state is not None:
        d[OBS_PREFIX + "state"] = np.ascontiguousarray(obs.state, np.float32)
    d["prompt"] = obs.task
    if seed is not None:
        d["seed"] = int(seed)
    return d


def _state(value: Any, path: str) -> np.ndarray:
    v = _decode_float_array(value, path)
    if v.ndim != 1 or v.shape[0] == 0:
        raise ProtocolError(path + ".shape", f"a state must be a non-empty 1-D vector, got {list(v.shape)}")
    if not np.all(np.isfinite(v)):
        raise ProtocolError(path, "values must be finite")
    return np.ascontiguousarray(v)


class _Frame:
    """What one openpi observation dict holds, read key by key (ProtocolError names the key)."""

    def __init__(self, limits: DecodeLimits, budget: ImageBudget | None = None):
        self.limits, self.budget = limits, budget or ImageBudget(limits)
        self.images: dict[str, np.ndarray] = {}
        self.state: np.ndarray | None = None
        self.task = ""
        self.params: dict[str, Any] = {}
        self.seen_state = self.seen_prompt = ""

    def add_image(self, cam: str, value: Any, path: str) -> None:
        if not cam:
            raise ProtocolError(path, "empty camera name")
        if cam in self.images:
            raise ProtocolError(path, f"camera {cam!r} sent twice")
        self.images[cam] = decode_image(value, path, budget=self.budget)

    def set_state(self, key: str, value: Any) -> None:
        if self.seen_state:
            raise ProtocolError(key, f"send either {self.seen_state} or {key}, not both")
        self.seen_state, self.state = key, _state(value, key)

    def set_prompt(self, key: str, value: Any) -> None:
        if self.seen_prompt:
            raise ProtocolError(key, f"send either {self.seen_prompt} or {key}, not both")
        if not isinstance(value, str):
            raise ProtocolError(key, f"expected a string, got {type(value).__name__}")
        if len(value) > self.limits.max_text_chars:
            raise ProtocolError(key, f"longer than {self.limits.max_text_chars} characters")
        self.seen_prompt, self.task = key, value

    def add_openpi_image(self, key: str, value: Any) -> None:
        try:
            self.add_image(key[len(OBS_PREFIX):], value, key)
        except ProtocolError as e:
            raise ProtocolError(key, f"{e.message} (wamkit reads observation/<camera> as a uint8 (H, W, 3) "
                                     f"image and observation/state as the state)", e.status) from None

    def add_images(self, key: str, value: Any) -> None:
        if not isinstance(value, dict) or not value:
            raise ProtocolError(key, "expected a non-empty {camera: image} mapping")
        for cam, img in value.items():
            self.add_image(str(cam), img, f"images.{cam}")

    def read(self, key: Any, value: Any) -> None:
        if not isinstance(key, str):
            raise ProtocolError(str(key), "observation keys must be strings")
        if key in STATE_KEYS:
            self.set_state(key, value)
        elif key in PROMPT_KEYS:
            self.set_prompt(key, value)
        elif key in FRAME_PARAMETERS:   # SGLang reads a frame's parameters from the frame itself
            self.params[key] = value
        elif key.startswith(OBS_PREFIX):
            self.add_openpi_image(key, value)
        elif key.startswith(SG_IMAGE_PREFIX):
            self.add_image(key[len(SG_IMAGE_PREFIX):], value, key)
        elif key == "images":
            self.add_images(key, value)
        elif key == "image":
            self.add_image(DEFAULT_CAMERA, value, key)
        elif key in IGNORED_KEYS:
            return
        elif key.removeprefix("observation.") in _SGLANG_ONLY_INPUTS:
            raise ProtocolError(key, "not served here (send images inline)", status=422)
        else:
            raise ProtocolError(key, "unknown observation key; send observation/<camera> images, "
                                     "observation/state, prompt (and optionally seed or SGLang's parameters: "
                                     "action_horizon, num_inference_steps, ...)")


def openpi_request(d: dict[str, Any], limits: DecodeLimits | None = None,
                   budget: ImageBudget | None = None) -> ActionRequest:
    """openpi (or SGLang raw) observation dict -> a one-observation ActionRequest: the observation, its seed
    (DEFAULT_SEED when none) and the parameters the frame carries (action_horizon, num_inference_steps, ...;
    validated as `parameters` over HTTP, errors naming the frame's key). `limits`: the server's decode limits (one
    image budget for the whole dict, as for an HTTP request: `budget`, default a fresh one)."""
    frame = _Frame(limits or DecodeLimits(), budget)
    for key, value in d.items():
        frame.read(key, value)
    if not frame.images:
        raise ProtocolError("observation/image", "no camera image in the observation")
    params, seeds, source = validate_parameters(frame.params, 1, frame.limits, prefix="")
    obs = Observation(images=frame.images, state=frame.state, task=frame.task)
    return ActionRequest(request_id="", observations=[obs], seeds=seeds, parameters=params, horizon_source=source)


def observation_from_openpi(d: dict[str, Any], limits: DecodeLimits | None = None) -> tuple[Observation, int]:
    """openpi (or SGLang raw) observation dict -> (Observation, seed); see openpi_request."""
    req = openpi_request(d, limits)
    return req.observations[0], req.seeds[0]


def is_action_request(d: dict[str, Any]) -> bool:
    """True for SGLang's action-request form (``input`` present), False for an openpi observation dict."""
    return "input" in d


def build_ws_request(observations: Sequence[Observation], seeds: Sequence[int], parameters: dict[str, Any] | None
                     = None, request_id: str | None = None) -> dict[str, Any]:
    """Observations -> an action request for SGLang's realtime websocket (to be sent with packb): images as arrays
    under ``input.images`` ({camera: image}; a list of them for several observations), state arrays, prompt(s),
    one seed (one observation) or a list of seeds."""
    n = len(observations)
    if n == 0:
        raise ValueError("no observations")
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} observations")
    imgs = [{c: np.ascontiguousarray(a) for c, a in o.images.items()} for o in observations]
    tasks = [o.task for o in observations]
    inp: dict[str, Any] = {"task": tasks[0] if len(set(tasks)) == 1 else tasks,
                           "images": imgs[0] if n == 1 else imgs}
    if any(o.state is not None for o in observations):
        if not all(o.state is not None for o in observations):
            raise ValueError("either every observation has a state or none has")
        states = [np.ascontiguousarray(o.state, np.float32) for o in observations]
        inp["state"] = states[0] if n == 1 else states
    params = dict(parameters or {})
    params["seed"] = int(seeds[0]) if n == 1 else [int(s) for s in seeds]
    return {"request_id": request_id or f"req_{uuid.uuid4().hex[:16]}", "input": inp, "parameters": params,
            "runtime": {"response_format": "envelope", "output_format": "numpy"}}


def decode_openpi_actions(body: dict[str, Any], raw_action_dim: int | None = None) -> np.ndarray:
    """An openpi reply ``{"actions": (H, D) array or lists, ...}`` -> float32 (H, D) (first raw_action_dim
    channels when given)."""
    if "actions" not in body:
        raise ProtocolError("actions", "missing required field")
    a = decode_action_values(body["actions"], "actions")
    if raw_action_dim:
        if raw_action_dim > a.shape[1]:
            raise ProtocolError("actions", f"raw_action_dim {raw_action_dim} > {a.shape[1]} channels sent")
        a = a[:, :raw_action_dim]
    return a
