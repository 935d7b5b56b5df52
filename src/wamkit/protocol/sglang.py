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
    if p["action_horizon"] <= 0 or p["action_horizon"] % 4:
        raise ValueError(f"SGLang needs action_horizon % 4 == 0 (temporal VAE), got {action_horizon}")
    nf = p.get("num_frames")
    if nf is not None and int(nf) != p["action_horizon"] + 1:
        raise ValueError(f"SGLang needs num_frames == action_horizon + 1, got {nf} for {action_horizon}")
    p["num_frames"] = p["action_horizon"] + 1
    if domain_name:
        p["domain_name"] = domain_name
    if domain_id is not None:
        p["domain_id"] = int(domain_id)
    if not domain_name and domain_id is None:
        raise ValueError("SGLang action requests need domain_name or domain_id")
    if domain_id is not None and not domain_name and raw_action_dim is None:
        raise ValueError("SGLang needs raw_action_dim when only domain_id is given")
    if raw_action_dim is not None:
        p["raw_action_dim"] = int(raw_action_dim)
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
    return {"request_id": request_id or f"req_{uuid.uuid4().hex[:16]}",
            "input": {"prompt": prompts[0] if len(set(prompts)) == 1 else prompts,
                      "image": imgs[0] if n == 1 else imgs},
            "parameters": params,
            "runtime": {"response_format": "envelope", "output_format": "numpy" if binary else "list"}}


def decode_sglang_response(body: dict[str, Any], raw_action_dim: int | None, expect_n: int | None = None
                           ) -> np.ndarray:
    """SGLang envelope -> float32 (N, H, raw_action_dim), sorted by input_index."""
    return parse_response(body, raw_action_dim=raw_action_dim, expect_n=expect_n).actions
