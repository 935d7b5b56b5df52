"""Cosmos3 LIBERO conventions on the wire: the request side (image layout, prompt) and the response side (decoding).

One place for them (pinned by tests/test_policy_cosmos3.py against hand-computed examples and scipy, and by
tests/test_sglang_compat.py against SGLang's own action entrypoint):
- image: agentview (`image`) and wrist (`wrist_image`) side by side (agentview left), 256x256 each -> 256x512,
  resized to 160x320 (PIL bicubic), then reflection-padded at the bottom to 192x320 (rows 160..191 mirror rows
  158..127: numpy/"reflect" mode, the edge row is not repeated);
- prompt and framing (`framing`): SGLang wraps the prompt in its own JSON action caption whose
  `cinematography.framing` sentence comes from the request's `action_view_point`. "recipe" (default, NVIDIA's LIBERO
  SFT recipe: the camera layout in the framing, the task alone as the description) sends
  action_view_point="concat_view" and the task text; "rlinf" (what RLinf's Cosmos3 SGLang adapter sends) sends
  action_view_point="ego_view" and the task followed by two sentences describing the concatenated views;
- parameters: policy mode, domain "libero" (domain id 5), raw_action_dim 10, action_horizon 16, num_frames 17,
  30 denoising steps, guidance 1.0, fps 20 (NVIDIA's LIBERO_LeRobot_v3 is 20 fps), height 192 / width 320 (SGLang's
  default 480x832 would resize and crop the image), action_view_point per framing;
- response: the first 10 channels, quantile denormalization ((n + 1) / 2 * (q99 - q01) + q01) unless the server
  already did it (`normalization="server"`: SGLang started with action stats), rot6d -> axis-angle (SVD projection,
  wamkit.data.transforms), gripper [0, 1] (1 = open) -> env (-1 open, +1 close): 1 - 2g.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from wamkit.core.errors import UserError
from wamkit.core.types import Observation

COSMOS3_CAMERAS = ("image", "wrist_image")            # left, right
CAMERA_SIZE = (256, 256)
RESIZED = (160, 320)                                  # (H, W) after resizing the 256x512 side-by-side image
PADDED = (192, 320)                                   # (H, W) sent to the server
RAW_ACTION_DIM = 10
ACTION_HORIZON = 16
LIBERO_DOMAIN = "libero"
LIBERO_DOMAIN_ID = 5
VIEWS_CAPTION = (" This video contains concatenated views from multiple camera perspectives."
                 " The left half shows the third-person view; the right half shows the wrist-mounted camera.")
# framing -> (action_view_point sent to SGLang, camera sentences appended to the task text)
FRAMINGS = {"recipe": ("concat_view", False), "rlinf": ("ego_view", True)}
DEFAULT_FRAMING = "recipe"


def check_framing(framing: str) -> str:
    if framing not in FRAMINGS:
        raise UserError(f"cosmos3 framing={framing!r}: valid choices are {', '.join(FRAMINGS)}")
    return framing


def cosmos3_parameters(num_inference_steps: int = 30, action_horizon: int = ACTION_HORIZON, fps: int = 20,
                       domain_name: str = LIBERO_DOMAIN, raw_action_dim: int = RAW_ACTION_DIM,
                       framing: str = DEFAULT_FRAMING) -> dict[str, Any]:
    """The `parameters` of an SGLang action request for Cosmos3 LIBERO (seed is added per request)."""
    return {"action_mode": "policy", "domain_name": domain_name, "raw_action_dim": int(raw_action_dim),
            "action_horizon": int(action_horizon), "num_frames": int(action_horizon) + 1,
            "num_inference_steps": int(num_inference_steps), "guidance_scale": 1.0, "fps": int(fps),
            "height": PADDED[0], "width": PADDED[1], "action_view_point": FRAMINGS[check_framing(framing)][0]}


def cosmos3_prompt(task: str, num_cameras: int = 2, framing: str = DEFAULT_FRAMING) -> str:
    """The prompt text sent for `task` (SGLang builds its JSON caption around it)."""
    p = task.strip()
    if num_cameras < 2 or not FRAMINGS[check_framing(framing)][1]:
        return p
    if not p.endswith("."):
        p += "."
    return p + VIEWS_CAPTION


def _resize(img: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    if img.shape[:2] == hw:
        return img
    return np.asarray(Image.fromarray(img).resize((hw[1], hw[0]), resample=Image.BICUBIC), dtype=np.uint8)


def cosmos3_image(images: dict[str, np.ndarray], cameras: Sequence[str] = COSMOS3_CAMERAS) -> np.ndarray:
    """Observation images -> the (192, 320, 3) uint8 image Cosmos3 was trained on."""
    parts = []
    for cam in cameras:
        if cam not in images:
            raise UserError(f"cosmos3 needs camera {cam!r}; the observation has {sorted(images)}")
        a = np.asarray(images[cam])
        if a.dtype != np.uint8 or a.ndim != 3 or a.shape[-1] != 3:
            raise UserError(f"camera {cam!r}: expected HxWx3 uint8, got {a.dtype} {a.shape}")
        parts.append(_resize(a, CAMERA_SIZE))
    side = np.concatenate(parts, axis=1)                          # (256, 512, 3), agentview left
    small = _resize(side, (RESIZED[0], RESIZED[1] * len(cameras) // 2))
    pad_h, pad_w = PADDED[0] - small.shape[0], PADDED[1] - small.shape[1]
    return np.pad(small, ((0, pad_h), (0, max(pad_w, 0)), (0, 0)), mode="reflect")


def cosmos3_observation(obs: Observation, cameras: Sequence[str] = COSMOS3_CAMERAS,
                        framing: str = DEFAULT_FRAMING) -> Observation:
    """An Observation as SGLang's Cosmos3 endpoint wants it: one image (`image`), the prompt as task, no state."""
    return Observation(images={"image": cosmos3_image(obs.images, cameras)}, state=None,
                       task=cosmos3_prompt(obs.task, len(cameras), framing))


def build_cosmos3_request(observations: Sequence[Observation], seed: int, num_inference_steps: int = 30,
                          binary: bool = False, request_id: str | None = None,
                          framing: str = DEFAULT_FRAMING) -> dict[str, Any]:
    """A complete `POST /v1/actions/generations` body (via wamkit.protocol's SGLang codec)."""
    from wamkit.protocol.sglang import build_sglang_request

    return build_sglang_request([cosmos3_observation(o, framing=framing) for o in observations], seed,
                                cosmos3_parameters(num_inference_steps, framing=framing), camera="image",
                                binary=binary, request_id=request_id)


def load_action_stats(stats: Any) -> tuple[np.ndarray, np.ndarray]:
    """q01, q99 (10,) from a dict {"q01","q99"}, a cosmos/RLinf stats JSON ({"global_raw"|"global": {...}}), or a
    path to either."""
    if isinstance(stats, (str, Path)):
        p = Path(stats)
        if not p.exists():
            raise UserError(f"action stats file not found: {p}")
        stats = json.loads(p.read_text())
    if not isinstance(stats, dict):
        raise UserError(f"action stats must be a mapping or a JSON path, got {type(stats).__name__}")
    for key in ("global_raw", "global"):
        if key in stats and isinstance(stats[key], dict):
            stats = stats[key]
            break
    if "q01" not in stats or "q99" not in stats:
        raise UserError(f"action stats need q01 and q99; got keys {sorted(stats)}")
    q01 = np.asarray(stats["q01"], np.float64).reshape(-1)[:RAW_ACTION_DIM]
    q99 = np.asarray(stats["q99"], np.float64).reshape(-1)[:RAW_ACTION_DIM]
    if q01.shape != (RAW_ACTION_DIM,) or q99.shape != (RAW_ACTION_DIM,):
        raise UserError(f"action stats need {RAW_ACTION_DIM} channels, got {q01.shape} / {q99.shape}")
    return q01, q99


def cosmos3_action_pipeline(stats: Any = None, clip: bool = False):
    """env 7-D <-> model 10-D normalized: [Rot6dStep, GripperStep(env <-> [0,1]), QuantileNormalizeStep].

    `inverse` is the response decoder's math: denormalize -> gripper [0,1] -> env -> rot6d -> axis-angle.
    Without stats the normalization step is left out (identity)."""
    from wamkit.data.transforms import ActionPipeline, GripperStep, QuantileNormalizeStep, Rot6dStep

    steps = [Rot6dStep(), GripperStep(index=-1, direction="env_to_01")]
    if stats is not None:
        q01, q99 = load_action_stats(stats)
        steps.append(QuantileNormalizeStep(q01, q99, clip=clip))
    return ActionPipeline(steps)


def decode_cosmos3_actions(values: np.ndarray, pipeline) -> np.ndarray:
    """(N, H, >=10) normalized model actions -> (N, H, 7) float32 env actions (first 10 channels kept)."""
    a = np.asarray(values, np.float32)
    if a.ndim == 2:
        a = a[None]
    if a.shape[-1] < RAW_ACTION_DIM:
        raise UserError(f"cosmos3 actions have {a.shape[-1]} channels, need at least {RAW_ACTION_DIM}")
    return np.asarray(pipeline.inverse(a[..., :RAW_ACTION_DIM]), np.float32)


def decode_cosmos3_response(body: dict[str, Any], pipeline, expect_n: int | None = None) -> np.ndarray:
    """SGLang envelope -> (N, H, 7) env actions, rows in input order."""
    from wamkit.protocol.sglang import decode_sglang_response

    return decode_cosmos3_actions(decode_sglang_response(body, RAW_ACTION_DIM, expect_n=expect_n), pipeline)
