"""The Policy interface: a batch of observations in, a batch of action chunks out.

Contract
- `predict(observations, seeds)` returns float32 actions of shape (N, horizon, action_dim) in the *environment's*
  action space (post-processing such as denormalization, rot6d -> axis-angle and gripper mapping is the policy's job).
- Determinism: the result for observation i depends only on (observation i, seeds[i]) and the weights, never on
  which other observations share the batch. Schedulers rely on this for schedule-invariant results.
- `sft_loss(batch)` returns (scalar loss tensor, dict of float metrics) for trainable policies.
- `spec` says what the policy consumes and produces; it travels with exported checkpoints.
- `remote_codec()`: a policy whose model runs behind another server (Cosmos3 behind SGLang) returns a RemoteCodec:
  the caller (the evaluation's server inference) runs encode -> its asynchronous transport -> decode, so the pre- and
  post-processing run in the evaluation process and several requests can be in flight. Others return None.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from wamkit.core.types import Observation


@dataclass(frozen=True)
class InputSpec:
    cameras: tuple[str, ...] = ()      # camera keys read from Observation.images ("" = any/none needed)
    image_size: int = 0                # square side the policy resizes to (0 = any)
    state_dim: int = 0                 # 0 = no proprio state used
    text: bool = False                 # uses the task text


@dataclass(frozen=True)
class ActionSpec:
    dim: int = 7                       # action dim in the env's action space
    horizon: int = 16                  # actions per chunk
    representation: str = "env"        # what the model outputs internally (e.g. "rot6d10"); predict() returns env space


@dataclass(frozen=True)
class PolicySpec:
    name: str
    input: InputSpec = field(default_factory=InputSpec)
    action: ActionSpec = field(default_factory=ActionSpec)
    deterministic: bool = True         # same (obs, seed) -> same chunk
    trainable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PolicySpec":
        return cls(name=d["name"], input=InputSpec(**{**d.get("input", {}),
                                                       "cameras": tuple(d.get("input", {}).get("cameras", ()))}),
                   action=ActionSpec(**d.get("action", {})), deterministic=d.get("deterministic", True),
                   trainable=d.get("trainable", False), extra=dict(d.get("extra", {})))


class RemoteCodec(abc.ABC):
    """Pre/post-processing of a policy served by another server, around a transport the caller owns."""

    protocol: str = "sglang"           # the wire form the server speaks (wamkit.protocol.client mode)
    camera: str = "image"              # the one camera key of the encoded observations
    raw_action_dim: int = 0            # channels of the model's output kept from each response
    server_normalizes: bool = False    # the server returns denormalized actions (it was started with action stats)

    @abc.abstractmethod
    def parameters(self) -> dict[str, Any]:
        """Request parameters (without the seed)."""

    @abc.abstractmethod
    def encode(self, observations: Sequence[Observation]) -> list[Observation]:
        """Env observations -> what is sent (e.g. one side-by-side image and the prompt)."""

    def seeds(self, seeds: Sequence[int]) -> list[int]:
        """The seed each observation is sent with (default: its own)."""
        return [int(s) for s in seeds]

    @abc.abstractmethod
    def decode(self, values: np.ndarray) -> np.ndarray:
        """(N, H, >= raw_action_dim) server output -> (N, H, action_dim) float32 env actions."""


class Policy(abc.ABC):
    spec: PolicySpec

    @abc.abstractmethod
    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        """(N, horizon, action_dim) float32 action chunks, one per observation, in the env's action space."""

    def sft_loss(self, batch: dict[str, Any]):
        from wamkit.core.errors import UserError

        raise UserError(f"policy {self.spec.name!r} is not trainable")

    def max_batch_size(self) -> int:
        """Largest batch predict() should get at once (servers and schedulers respect it)."""
        return 64

    def remote_codec(self) -> RemoteCodec | None:
        """How to reach this policy's model on another server (see RemoteCodec); None: predict() is all there is."""
        return None

    def warmup(self, max_batch: int | None = None) -> dict[str, float]:
        """One-off work before the first real call (e.g. capturing CUDA graphs for every batch size up to
        max_batch); servers call it before they report healthy. Returns seconds per step; default: nothing to do."""
        return {}

    def close(self) -> None:  # noqa: B027
        pass
