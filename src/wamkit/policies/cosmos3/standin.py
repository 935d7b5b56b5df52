"""`cosmos3-standin`: answers Cosmos3's SGLang request form with any wamkit policy, so the whole reference flow
(`wamkit eval` of Cosmos3 behind SGLang) runs where SGLang and the Cosmos3 weights cannot (a CPU machine, CI).

Served by `wamkit serve policy=cosmos3-standin ...`, it takes what the Cosmos3 adapter sends (one 192x320
side-by-side image per observation, the prompt, one seed per request) and returns what SGLang's Cosmos3 pipeline
returns in policy mode: normalized 10-D actions (rot6d, gripper in [0, 1], quantile-normalized with `action_stats`),
zero-padded to `padded_action_dim` channels (the server keeps the first `raw_action_dim` the request asks for). In
between, it undoes the adapter's layout (top 160 rows; left half agentview, right half wrist, each resized back to
256x256), strips the "rlinf" framing's camera sentences from the prompt, and asks the `inner` policy (e.g. `wam-ref`
trained on LIBERO data, or `fixed-cost` as a model of known cost) for env actions. The adapter's decoder then inverts
the encoding, so the evaluation sees the inner policy's actions (up to float rounding of the rot6d round trip).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np

from wamkit.core.config import check_number
from wamkit.core.errors import ConfigError, UserError
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, InputSpec, Policy, PolicySpec
from wamkit.policies.cosmos3 import io as C


def split_side_by_side(image: np.ndarray) -> dict[str, np.ndarray]:
    """The adapter's (192, 320, 3) image -> {"image": agentview, "wrist_image": wrist}, each 256x256."""
    a = np.asarray(image)
    if a.shape != (*C.PADDED, 3) or a.dtype != np.uint8:
        raise UserError(f"cosmos3-standin expects the adapter's {C.PADDED[0]}x{C.PADDED[1]}x3 uint8 side-by-side "
                        f"image, got {a.dtype} {list(a.shape)}")
    top = a[:C.RESIZED[0]]
    half = C.RESIZED[1] // 2
    return {cam: C._resize(np.ascontiguousarray(top[:, k * half:(k + 1) * half]), C.CAMERA_SIZE)
            for k, cam in enumerate(C.COSMOS3_CAMERAS)}


def task_of_prompt(prompt: str) -> str:
    """The task text inside a prompt the adapter sent (either framing)."""
    p = prompt.strip()
    return p[: -len(C.VIEWS_CAPTION)].rstrip(".") if p.endswith(C.VIEWS_CAPTION.strip()) else p


@dataclass(frozen=True)
class Cosmos3StandInConfig:
    RENAMED: ClassVar[dict[str, str]] = {"max_batch": "max_batch_size"}   # old key spelling (still loads, warns)
    inner: str = "fixed-cost"          # the wamkit policy that answers (registered name or export dir)
    inner_args: dict[str, Any] = field(default_factory=dict)  # the inner policy's options (inner_args.k=v)
    action_stats: Any = None           # q01/q99 of the 10-D actions (a dict or stats JSON): the adapter's, required
    padded_action_dim: int = 64        # channels of each returned action (zero-padded after the 10 real ones)
    max_batch_size: int = 8            # largest batch one predict() call gets (max_batch_size())

    def validate(self) -> None:
        if self.padded_action_dim < C.RAW_ACTION_DIM:
            raise ConfigError(f"padded_action_dim must be >= {C.RAW_ACTION_DIM}, got {self.padded_action_dim}")
        check_number("max_batch_size", self.max_batch_size, lo=1)


class Cosmos3StandIn(Policy):
    name = "cosmos3-standin"
    config_class = Cosmos3StandInConfig

    def __init__(self, config: Cosmos3StandInConfig | None = None, **kwargs):
        from wamkit.policies.registry import make_policy

        self.config = cfg = self.make_config(config, **kwargs)
        inner, action_stats = cfg.inner, cfg.action_stats
        if action_stats is None:
            raise UserError("cosmos3-standin needs action_stats= (q01/q99 of the 10-D actions, a dict or stats JSON): "
                            "it normalizes like Cosmos3, and the adapter must be given the same stats")
        kw = {"action_dim": 7, "horizon": C.ACTION_HORIZON, **cfg.inner_args}
        self.inner = make_policy(inner, **kw)
        ih, idim = self.inner.spec.action.horizon, self.inner.spec.action.dim
        if (ih, idim) != (C.ACTION_HORIZON, 7):
            raise UserError(f"cosmos3-standin's inner policy must produce (16, 7) LIBERO chunks, {inner!r} makes "
                            f"({ih}, {idim})")
        if self.inner.spec.input.state_dim:
            raise UserError(f"cosmos3-standin's inner policy must not read proprio state (Cosmos3 LIBERO gets none); "
                            f"{inner!r} reads {self.inner.spec.input.state_dim}-D state")
        self.pipeline = C.cosmos3_action_pipeline(action_stats)
        self.padded, self._max_batch_size = cfg.padded_action_dim, cfg.max_batch_size
        self.spec = PolicySpec(name=self.name,
                               input=InputSpec(cameras=("image",), image_size=0, state_dim=0, text=True),
                               action=ActionSpec(dim=self.padded, horizon=C.ACTION_HORIZON, representation="rot6d10"),
                               deterministic=self.inner.spec.deterministic,
                               extra={"inner": inner, "policy_family": "cosmos3", "raw_action_dim": C.RAW_ACTION_DIM,
                                      "request_rules": "sglang"})

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        env_obs = [Observation(images=split_side_by_side(o.images["image"]), state=None, task=task_of_prompt(o.task))
                   for o in observations]
        env_actions = np.asarray(self.inner.predict(env_obs, list(seeds)), np.float64)
        normalized = np.asarray(self.pipeline.forward(env_actions), np.float32)      # (N, 16, 10)
        out = np.zeros((len(observations), C.ACTION_HORIZON, self.padded), np.float32)
        out[..., :C.RAW_ACTION_DIM] = normalized
        return out

    def max_batch_size(self) -> int:
        return self._max_batch_size

    def warmup(self, max_batch_size: int | None = None) -> dict[str, float]:
        return self.inner.warmup(max_batch_size)

    def close(self) -> None:
        self.inner.close()
