"""Plumbing policies: `zero` (holds still, gripper open), `random` (seeded per observation seed),
`fixed-cost` (a known inference cost per batch, for scheduler benchmarks)."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, Policy, PolicySpec

# Gripper convention of the env action space (LIBERO and MetaWorld wrappers): -1 = open, +1 = close.
GRIPPER_OPEN = -1.0


class ZeroPolicy(Policy):
    """Holds still: zero deltas, gripper open (last channel = GRIPPER_OPEN)."""

    def __init__(self, action_dim: int = 7, horizon: int = 16):
        self.spec = PolicySpec(name="zero", action=ActionSpec(dim=action_dim, horizon=horizon))

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        a = np.zeros((len(observations), self.spec.action.horizon, self.spec.action.dim), np.float32)
        a[..., -1] = GRIPPER_OPEN
        return a

    def max_batch_size(self) -> int:
        return 1024


class RandomPolicy(Policy):
    """Uniform actions in [-scale, scale]; the chunk for an observation depends only on its seed."""

    def __init__(self, action_dim: int = 7, horizon: int = 16, scale: float = 1.0):
        self.scale = float(scale)
        self.spec = PolicySpec(name="random", action=ActionSpec(dim=action_dim, horizon=horizon))

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        h, d = self.spec.action.horizon, self.spec.action.dim
        out = np.empty((len(observations), h, d), np.float32)
        for i, s in enumerate(seeds):
            out[i] = np.random.default_rng(int(s)).uniform(-self.scale, self.scale, (h, d))
        return out

    def max_batch_size(self) -> int:
        return 1024


class FixedCostPolicy(RandomPolicy):
    """`random` plus a known inference cost: `base_ms + per_obs_ms * N` per batch of N.

    mode=sleep models a GPU (the CPU is free while it computes); mode=spin burns one CPU core for that time.
    `scale` defaults to 0.3 so episodes do not fly off; actions depend only on the seed (deterministic)."""

    def __init__(self, action_dim: int = 7, horizon: int = 16, base_ms: float = 200.0, per_obs_ms: float = 5.0,
                 mode: str = "sleep", scale: float = 0.3, max_batch: int = 64):
        super().__init__(action_dim=action_dim, horizon=horizon, scale=scale)
        self.base_ms, self.per_obs_ms, self.mode, self.max_batch = float(base_ms), float(per_obs_ms), mode, max_batch
        self.spec = PolicySpec(name="fixed-cost", action=ActionSpec(dim=action_dim, horizon=horizon),
                               extra={"base_ms": self.base_ms, "per_obs_ms": self.per_obs_ms, "mode": mode})

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
        return self.max_batch
