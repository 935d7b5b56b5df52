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
from wamkit.protocol.messages import DEFAULT_CAMERA, parse_response

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
    seed = params.get("seed", 42)
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


def decode_sglang_response(body: dict[str, Any], raw_action_dim: int | None, expect_n: int | None = None
                           ) -> np.ndarray:
    """SGLang envelope -> float32 (N, H, raw_action_dim), sorted by input_index."""
    return parse_response(body, raw_action_dim=raw_action_dim, expect_n=expect_n).actions
