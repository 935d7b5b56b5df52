"""The Policy interface, the registry of policies by name, built-in policies and adapters to external models."""

from wamkit.policies.base import ActionSpec, InputSpec, Policy, PolicySpec  # noqa: F401
from wamkit.policies.registry import make_policy, policy_names, register_policy  # noqa: F401
