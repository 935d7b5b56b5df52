"""Registered policy names -> their classes, imported lazily (`package.module:Class` targets).

The bottom of the policy factory: `export.py` (rebuilds an exported policy by name) and `registry.py`
(`make_policy`) both read it; it imports neither.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from wamkit.core.errors import UserError, unknown_choice

_REGISTRY: dict[str, str] = {
    "zero": "wamkit.policies.simple:ZeroPolicy",
    "random": "wamkit.policies.simple:RandomPolicy",
    "metaworld-expert": "wamkit.policies.metaworld_expert:MetaWorldExpertPolicy",
    "wam-ref": "wamkit.policies.wam_ref.policy:WamRefPolicy",
    "cosmos3": "wamkit.policies.cosmos3.policy:Cosmos3Policy",
    "cosmos3-standin": "wamkit.policies.cosmos3.standin:Cosmos3StandIn",
    "fixed-cost": "wamkit.policies.simple:FixedCostPolicy",
}


def register_policy(name: str, target: str) -> None:
    _REGISTRY[name] = target


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def policy_class(name: str):
    if name not in _REGISTRY:
        err = unknown_choice("policy", name, policy_names() + ["<dir written by wamkit export>"])
        d = Path(name)
        if d.is_dir() and ((d / "checkpoints").is_dir() or (d / "policy.json").exists()):   # a training run/step
            err = UserError(f"{name} is a training run or checkpoint, not a servable policy: `wamkit export {name} "
                            f"OUT` writes one (then policy=OUT)")
        raise err
    mod, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)
