"""Codec for an SGLang action server (`sglang serve --model-type diffusion`): payloads SGLang accepts as they are.

What SGLang's action endpoint accepts (and what this module therefore sends):
- one image per observation (`input.image`: one image, or a list of N for a batch in policy mode, N at most
  `--batching-max-size`); no extra cameras, no proprio state;
- one prompt (`input.prompt`: str, or N strings; prompts of different token lengths cannot share a batch, so callers
  group observations by prompt text before building a request);
- one integer seed per request;
- `num_frames == action_horizon + 1` and `action_horizon % 4 == 0`; `domain_name` (or `domain_id` + `raw_action_dim`).
msgpack bodies carry images as SGLang's array marker ``{"__ndarray__": true, "data", "dtype", "shape"}``, which its
msgpack hook turns into numpy arrays without any PNG work; JSON bodies carry ``{"b64_json": <PNG>}``.
The response values may be padded past raw_action_dim and may come back in any order: decode_sglang_response keeps the
first raw_action_dim channels and sorts by input_index.

SGLang's defaults for fields a request leaves out (checked against sglang 0.5.23's Cosmos3 action entrypoint) are not
what a LIBERO client wants: 480x832 (a smaller image is resized and cropped), seed 42, 35 steps, fps 5,
`action_view_point` "ego_view". build_sglang_request therefore always sends `height`/`width` (the image's own size
unless the caller set them), and check_sglang_request refuses, before anything is sent, every request SGLang's
entrypoint would answer with 400 (batch over `--batching-max-size`, a seed that is not one non-negative integer,
horizon/frames rules, prompt count, non-uint8 images).
"""

from __future__ import annotations

import uuid
from typing import Any, Sequence

import numpy as np

from wamkit.core.types import Observation
from wamkit.protocol.images import encode_image
from wamkit.protocol.messages import DEFAULT_CAMERA, DEFAULT_SEED, parse_response

SGLANG_DEFAULTS: dict[str, Any] = {"action_mode": "policy", "action_horizon": 16, "num_inference_steps": 30,
                                   "guidance_scale": 1.0, "fps": 20}


def sglang_parameters(raw_action_dim: int | None = None, domain_name: str | None = None,
                      domain_id: int | None = None, action_horizon: int = 16, **extra: Any) -> dict[str, Any]:
    """SGLang `parameters` with its rules checked (ValueError names the rule)."""
    p = {**SGLANG_DEFAULTS, **{k: v for k, v in extra.items() if v is not None}}
    p["action_horizon"] = int(action_horizon)
    if domain_name:
        p["domain_name"] = domain_name
    if domain_id is not None:
        p["domain_id"] = int(domain_id)
    if raw_action_dim is not None:
        p["raw_action_dim"] = int(raw_action_dim)
    refusal = sglang_parameter_refusal(p)
    if refusal is not None:
        raise ValueError(f"{refusal[0]}: {refusal[1]}")
    p["num_frames"] = p["action_horizon"] + 1
    if p.get("candidate_count", 1) > 1:
        raise ValueError("candidate_count > 1 is only valid with one image; wamkit does not use it")
    return p


def build_sglang_request(observations: Sequence[Observation], seed: int, parameters: dict[str, Any],
                         camera: str = DEFAULT_CAMERA, binary: bool = True, request_id: str | None = None,
                         max_batch_size: int | None = None) -> dict[str, Any]:
    """N observations (one camera each is sent: `camera`) -> a request body SGLang accepts."""
    n = len(observations)
    if n == 0:
        raise ValueError("no observations")
    if max_batch_size is not None and n > max_batch_size:
        raise ValueError(f"{n} observations exceed the server's --batching-max-size={max_batch_size}")
    imgs = []
    for i, o in enumerate(observations):
        if camera not in o.images:
            raise ValueError(f"observation {i} has no camera {camera!r} (has {sorted(o.images)})")
        imgs.append(encode_image(o.images[camera], "ndarray" if binary else "png"))
    prompts = [o.task for o in observations]
    params = dict(parameters)
    params["seed"] = int(seed)
    params.setdefault("num_frames", int(params.get("action_horizon", 16)) + 1)
    h, w = observations[0].images[camera].shape[:2]
    params.setdefault("height", int(h))      # else SGLang resizes and crops the image to its 480x832 default
    params.setdefault("width", int(w))
    return {"request_id": request_id or f"req_{uuid.uuid4().hex[:16]}",
            "input": {"prompt": prompts[0] if len(set(prompts)) == 1 else prompts,
                      "image": imgs[0] if n == 1 else imgs},
            "parameters": params,
            "runtime": {"response_format": "envelope", "output_format": "numpy" if binary else "list"}}


def check_sglang_request(body: dict[str, Any], max_batch_size: int | None = None) -> None:
    """Refuse (ValueError naming the field) what SGLang's action entrypoint would refuse with 400, before sending."""
    inp, params = body.get("input") or {}, body.get("parameters") or {}
    imgs = inp.get("image", inp.get("input_reference"))
    n = len(imgs) if isinstance(imgs, list) else 1
    if imgs is None:
        raise ValueError("input.image: SGLang's policy mode needs one image per observation")
    if max_batch_size is not None and n > int(max_batch_size):
        raise ValueError(f"input.image: {n} observations exceed the server's --batching-max-size={max_batch_size}")
    for i, im in enumerate(imgs if isinstance(imgs, list) else [imgs]):
        if isinstance(im, dict) and "__ndarray__" in im and np.dtype(im.get("dtype")) != np.uint8:
            raise ValueError(f"input.image[{i}]: SGLang needs uint8 images, got {im.get('dtype')}")
    prompt = inp.get("prompt", inp.get("task"))
    if isinstance(prompt, list) and len(prompt) not in (1, n):
        raise ValueError(f"input.prompt: {len(prompt)} prompts for {n} images (one, or one per image)")
    if not isinstance(prompt, (str, list)):
        raise ValueError("input.prompt: a string or a list of strings")
    seed = params.get("seed", DEFAULT_SEED)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"parameters.seed: SGLang takes one non-negative integer per request, got {seed!r}")
    refusal = sglang_parameter_refusal(params)
    if refusal is not None:
        raise ValueError(f"{refusal[0]}: {refusal[1]}")


def sglang_parameter_refusal(params: dict[str, Any]) -> tuple[str, str] | None:
    """(field path, why) for action parameters SGLang's Cosmos3 entrypoint refuses with 400, else None: checked by
    the client before sending and by `wamkit serve` for policies that answer in SGLang's place (cosmos3-standin), so
    a CPU run through the stand-in refuses what SGLang would."""
    h, nf = params.get("action_horizon"), params.get("num_frames")
    if h is not None and (int(h) <= 0 or int(h) % 4):
        return "parameters.action_horizon", f"must be a positive multiple of 4, got {h}"
    if h is not None and nf is not None and int(nf) != int(h) + 1:
        return "parameters.num_frames", f"must be action_horizon + 1 = {int(h) + 1}, got {nf}"
    if not params.get("domain_name") and params.get("domain_id") is None:
        return "parameters.domain_name", "SGLang needs domain_name or domain_id"
    if params.get("domain_id") is not None and not params.get("domain_name") and params.get("raw_action_dim") is None:
        return "parameters.raw_action_dim", "needed when only domain_id is given"
    if params.get("action_mode", "policy") != "policy":
        return "parameters.action_mode", "wamkit sends policy mode only"
    return None


# ------------------------------------------------------------------- any observation, to a server that is not wamkit
def is_wamkit_server(metadata: dict[str, Any] | None) -> bool:
    """Whether an action server's metadata is wamkit's (`server.name`): only then are wamkit's own request forms
    sent (several cameras and states per batch, one seed per observation); any other server gets SGLang's."""
    server = (metadata or {}).get("server")
    return isinstance(server, dict) and server.get("name") == "wamkit"


def sglang_batchable(o: Observation) -> bool:
    """Whether SGLang's batch form can carry `o` beside others: one camera and no state (SGLang batches
    observations only on Cosmos3's path, `input.images = {camera: [image] * N}`, which reads one image each)."""
    return len(o.images) == 1 and o.state is None


def sglang_group_key(o: Observation, seed: int) -> tuple:
    """What observations must share to go in one SGLang request: prompt text (prompts of different token lengths
    cannot share its batch), cameras and image shapes, state length, and the seed (SGLang takes one a request)."""
    cams = tuple(sorted((k, tuple(v.shape)) for k, v in o.images.items()))
    return o.task, cams, None if o.state is None else int(o.state.shape[0]), int(seed)


def plan_sglang_requests(observations: Sequence[Observation], seeds: Sequence[int], limit: int) -> list[list[int]]:
    """Indices of each request to a server that is not wamkit: observations grouped by sglang_group_key (so every
    observation is computed with its own seed, as it would be alone), at most `limit` a request, one a request when
    SGLang's batch form cannot carry them (several cameras, or a state)."""
    groups: dict[tuple, list[int]] = {}
    for i, (o, s) in enumerate(zip(observations, seeds)):
        groups.setdefault(sglang_group_key(o, s), []).append(i)
    out = []
    for idx in groups.values():
        step = max(1, int(limit)) if sglang_batchable(observations[idx[0]]) else 1
        out += [idx[k:k + step] for k in range(0, len(idx), step)]
    return out


def _image_value(a: np.ndarray, encoding: str) -> Any:
    return np.ascontiguousarray(a) if encoding == "array" else encode_image(a, encoding)


def build_sglang_observation_request(observations: Sequence[Observation], seed: int, parameters: dict[str, Any],
                                     encoding: str = "array", request_id: str | None = None) -> dict[str, Any]:
    """Observations of one plan_sglang_requests group -> a request in SGLang's own forms: one observation as
    `input.images = {camera: image, ...}` (+ `input.state`, a vector), several as SGLang's batch form
    `input.images = {camera: [image] * N}` (one camera, no state); `input.task`; ONE integer seed. encoding: "array"
    (numpy arrays, for openpi's msgpack packer), "ndarray" (the array marker, for encode_body's msgpack) or "png"
    (JSON: `{"b64_json"}`, and lists for the state)."""
    n = len(observations)
    if n == 0:
        raise ValueError("no observations")
    if n > 1 and not all(sglang_batchable(o) for o in observations):
        raise ValueError("SGLang's batch form carries one camera and no state: send such observations one a request")
    if n == 1:
        images = {c: _image_value(a, encoding) for c, a in observations[0].images.items()}
    else:
        cam = next(iter(observations[0].images))
        images = {cam: [_image_value(o.images[cam], encoding) for o in observations]}
    tasks = [o.task for o in observations]
    inp: dict[str, Any] = {"task": tasks[0] if len(set(tasks)) == 1 else tasks, "images": images}
    state = observations[0].state
    if n == 1 and state is not None:
        state = np.ascontiguousarray(state, np.float32)
        inp["state"] = state if encoding == "array" else state.tolist()
    h, w = np.shape(next(iter(observations[0].images.values())))[:2]
    params = {"height": int(h), "width": int(w), **parameters, "seed": int(seed)}   # as build_sglang_request: else
    return {"request_id": request_id or f"req_{uuid.uuid4().hex[:16]}", "input": inp,   # SGLang resizes to 480x832
            "parameters": params,
            "runtime": {"response_format": "envelope", "output_format": "list" if encoding == "png" else "numpy"}}


def decode_sglang_response(body: dict[str, Any], raw_action_dim: int | None, expect_n: int | None = None
                           ) -> np.ndarray:
    """SGLang envelope -> float32 (N, H, raw_action_dim), sorted by input_index."""
    return parse_response(body, raw_action_dim=raw_action_dim, expect_n=expect_n).actions
