"""`metaworld-expert`: MetaWorld's scripted expert policies (metaworld.policies.ENV_POLICY_MAP) as a wamkit Policy.

The experts are closed-loop per step: they read the 39-D observation (Observation.state) and output one 4-D action.
A chunk of H actions is executed open-loop, so with horizon H this policy repeats the expert's action H times.
The default horizon is 1 (every step closed-loop): with it the experts solve >= 5 of 6 episodes of reach-v3 and
drawer-open-v3 (tests/test_envs_metaworld.py). Larger horizons are allowed but their success rate is not measured.
The task comes from the instruction text, inverted with task_from_instruction (the env side defines the forward
rule, wamkit.envs.metaworld.task_instruction; policies do not import envs; a test pins both directions).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from wamkit.core.errors import ConfigError, UserError
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, ChunkConfig, InputSpec, Policy, PolicySpec

# the experts' proportional controllers warn on most steps that their gains exceed [-1, 1] (the env clips, as meant):
# noise that buries everything else a recording prints
warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high", category=UserWarning,
                        module=r"metaworld\.policies")


def task_from_instruction(text: str) -> str:
    """'pick place' -> 'pick-place-v3' (the inverse of the env's instruction rule)."""
    return "-".join(text.strip().split()) + "-v3"


@dataclass(frozen=True)
class MetaWorldExpertConfig(ChunkConfig):
    action_dim: int = 4                # MetaWorld's action dimension (the only one the experts produce)
    horizon: int = 1                   # actions per chunk: the expert's one action repeated (1 = closed loop)

    def validate(self) -> None:
        super().validate()
        if self.action_dim != 4:
            raise ConfigError(f"action_dim: metaworld-expert produces 4-D actions, got {self.action_dim}")


class MetaWorldExpertPolicy(Policy):
    name = "metaworld-expert"
    config_class = MetaWorldExpertConfig

    def __init__(self, config: MetaWorldExpertConfig | None = None, **kwargs):
        self.config = cfg = self.make_config(config, **kwargs)
        self.spec = PolicySpec(name=self.name, input=InputSpec(state_dim=39, text=True),
                               action=ActionSpec(dim=4, horizon=cfg.horizon))
        self._experts: dict[str, object] = {}

    def _expert(self, task: str):
        if task not in self._experts:
            from metaworld.policies import ENV_POLICY_MAP

            if task not in ENV_POLICY_MAP:
                raise UserError(f"no MetaWorld expert for task {task!r} (from the instruction text)")
            self._experts[task] = ENV_POLICY_MAP[task]()
        return self._experts[task]

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        h = self.spec.action.horizon
        out = np.empty((len(observations), h, 4), np.float32)
        for i, ob in enumerate(observations):
            if ob.state is None or ob.state.shape[-1] != 39:
                raise UserError("metaworld-expert needs Observation.state = the 39-D MetaWorld observation")
            a = np.asarray(self._expert(task_from_instruction(ob.task)).get_action(
                np.asarray(ob.state, np.float64)), np.float32)
            out[i] = np.clip(a, -1.0, 1.0)[None, :]
        return out

    def max_batch_size(self) -> int:
        return 1024
