"""Policies by name, imported lazily. A directory written by `wamkit export` is also a valid policy name."""

from __future__ import annotations

import importlib
from pathlib import Path

from wamkit.core.errors import unknown_choice
from wamkit.policies.base import Policy

_REGISTRY: dict[str, str] = {
    "zero": "wamkit.policies.simple:ZeroPolicy",
    "random": "wamkit.policies.simple:RandomPolicy",
    "metaworld-expert": "wamkit.policies.metaworld_expert:MetaWorldExpertPolicy",
    "wam-ref": "wamkit.policies.wam_ref.policy:WamRefPolicy",
    "cosmos3": "wamkit.policies.cosmos3.policy:Cosmos3Policy",
    "cosmos3-standin": "wamkit.policies.cosmos3.standin:Cosmos3StandIn",
    "fixed-cost": "wamkit.policies.simple:FixedCostPolicy",
}

EXPORT_MARKER = "wamkit_policy.json"


def register_policy(name: str, target: str) -> None:
    _REGISTRY[name] = target


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def policy_class(name: str):
    if name not in _REGISTRY:
        raise unknown_choice("policy", name, policy_names() + ["<dir written by wamkit export>"])
    mod, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def make_policy(name: str, **kwargs) -> Policy:
    """Build a policy by registered name or from an exported directory.

    Common kwargs (each policy ignores what it does not use): action_dim, horizon, device, plus its own options."""
    p = Path(name)
    if (p / EXPORT_MARKER).exists():
        from wamkit.policies.export import load_exported

        return load_exported(p, **kwargs)
    return policy_class(name)(**kwargs)
