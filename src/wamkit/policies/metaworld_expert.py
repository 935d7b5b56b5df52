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
from typing import Sequence

import numpy as np

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, InputSpec, Policy, PolicySpec

DEFAULT_HORIZON = 1
# the experts' proportional controllers warn on most steps that their gains exceed [-1, 1] (the env clips, as meant):
# noise that buries everything else a recording prints
warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high", category=UserWarning,
                        module=r"metaworld\.policies")


def task_from_instruction(text: str) -> str:
    """'pick place' -> 'pick-place-v3' (the inverse of the env's instruction rule)."""
    return "-".join(text.strip().split()) + "-v3"


class MetaWorldExpertPolicy(Policy):
    def __init__(self, action_dim: int = 4, horizon: int = DEFAULT_HORIZON):
        if int(action_dim) != 4:
            raise UserError(f"metaworld-expert produces 4-D actions, got action_dim={action_dim}")
        if int(horizon) < 1:
            raise UserError(f"horizon must be >= 1, got {horizon}")
        self.spec = PolicySpec(name="metaworld-expert", input=InputSpec(state_dim=39, text=True),
                               action=ActionSpec(dim=4, horizon=int(horizon)))
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
