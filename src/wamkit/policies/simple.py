"""Plumbing policies: `zero` (holds still, gripper open), `random` (seeded per observation seed),
`fixed-cost` (a known inference cost per batch, for scheduler benchmarks)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Literal, Sequence

import numpy as np

from wamkit.core.config import check_number
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, ChunkConfig, Policy, PolicySpec

# Gripper convention of the env action space (LIBERO and MetaWorld wrappers): -1 = open, +1 = close.
GRIPPER_OPEN = -1.0


@dataclass(frozen=True)
class ZeroConfig(ChunkConfig):
    """`zero`: only the chunk shape (action_dim, horizon)."""


@dataclass(frozen=True)
class RandomConfig(ChunkConfig):
    scale: float = 1.0                 # actions are uniform in [-scale, scale]

    def validate(self) -> None:
        super().validate()
        check_number("scale", self.scale, lo=0)


@dataclass(frozen=True)
class FixedCostConfig(RandomConfig):
    RENAMED: ClassVar[dict[str, str]] = {"max_batch": "max_batch_size"}   # old key spelling (still loads, warns)
    base_ms: float = 200.0             # inference cost of every batch, in ms
    per_obs_ms: float = 5.0            # plus this much per observation of the batch, in ms
    mode: Literal["sleep", "spin"] = "sleep"  # sleep: the CPU is free meanwhile (a GPU model); spin: burn one core
    scale: float = 0.3                 # actions are uniform in [-scale, scale] (small, so episodes do not fly off)
    max_batch_size: int = 64           # largest batch one predict() call gets (max_batch_size())

    def validate(self) -> None:
        super().validate()
        check_number("base_ms", self.base_ms, lo=0)
        check_number("per_obs_ms", self.per_obs_ms, lo=0)
        check_number("max_batch_size", self.max_batch_size, lo=1)


class ZeroPolicy(Policy):
    """Holds still: zero deltas, gripper open (last channel = GRIPPER_OPEN)."""

    name = "zero"
    config_class = ZeroConfig

    def __init__(self, config: ZeroConfig | None = None, **kwargs):
        self.config = cfg = self.make_config(config, **kwargs)
        self.spec = PolicySpec(name=self.name, action=ActionSpec(dim=cfg.action_dim, horizon=cfg.horizon))

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        a = np.zeros((len(observations), self.spec.action.horizon, self.spec.action.dim), np.float32)
        a[..., -1] = GRIPPER_OPEN
        return a

    def max_batch_size(self) -> int:
        return 1024


class RandomPolicy(Policy):
    """Uniform actions in [-scale, scale]; the chunk for an observation depends only on its seed."""

    name = "random"
    config_class = RandomConfig

    def __init__(self, config: RandomConfig | None = None, **kwargs):
        self.config = cfg = self.make_config(config, **kwargs)
        self.scale = float(cfg.scale)
        self.spec = PolicySpec(name=self.name, action=ActionSpec(dim=cfg.action_dim, horizon=cfg.horizon))

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        h, d = self.spec.action.horizon, self.spec.action.dim
        out = np.empty((len(observations), h, d), np.float32)
        for i, s in enumerate(seeds):
            out[i] = np.random.default_rng(int(s)).uniform(-self.scale, self.scale, (h, d))
        return out

    def replica(self) -> "RandomPolicy":
        """predict keeps no state: this handle itself may run in several threads at once (fixed-cost's concurrent
        batches then each take their full cost, overlapping: a device that runs them side by side for free)."""
        return self

    def max_batch_size(self) -> int:
        return 1024


class FixedCostPolicy(RandomPolicy):
    """`random` plus a known inference cost: `base_ms + per_obs_ms * N` per batch of N.

    mode=sleep models a GPU (the CPU is free while it computes); mode=spin burns one CPU core for that time.
    `scale` defaults to 0.3 so episodes do not fly off; actions depend only on the seed (deterministic)."""

    name = "fixed-cost"
    config_class = FixedCostConfig

    def __init__(self, config: FixedCostConfig | None = None, **kwargs):
        super().__init__(config, **kwargs)
        cfg = self.config
        self.base_ms, self.per_obs_ms, self.mode = cfg.base_ms, cfg.per_obs_ms, cfg.mode
        self._max_batch_size = cfg.max_batch_size
        self.spec = PolicySpec(name=self.name, action=ActionSpec(dim=cfg.action_dim, horizon=cfg.horizon),
                               extra={"base_ms": self.base_ms, "per_obs_ms": self.per_obs_ms, "mode": cfg.mode})
    def cost_s(self, n: int) -> float:
        return (self.base_ms + self.per_obs_ms * n) / 1000.0

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        t_end = time.perf_counter() + self.cost_s(len(observations))
        out = super().predict(observations, seeds)
        if self.mode == "spin":
            while time.perf_counter() < t_end:
                pass
        else:
            time.sleep(max(0.0, t_end - time.perf_counter()))
        return out

    def max_batch_size(self) -> int:
        return self._max_batch_size
