"""Policies by name: `make_policy(name_or_export_dir, **kwargs)`. The names live in `catalog.py`; a directory
written by `wamkit export` (it holds `wamkit_policy.json`, see `manifest.py`) is also a valid policy name."""

from __future__ import annotations

from wamkit.policies.base import Policy
from wamkit.core.config import check_options, option_names
from wamkit.policies.catalog import policy_class, policy_names, register_policy  # noqa: F401
from wamkit.policies.export import load_exported
from wamkit.policies.manifest import EXPORT_MARKER, is_export_dir  # noqa: F401


# what evaluation, serving and training pass to every policy (a policy ignores those it does not use)
COMMON_KWARGS = ("action_dim", "horizon", "device")


def make_policy(name: str, **kwargs) -> Policy:
    """Build a policy by registered name or from an exported directory.

    Common kwargs (each policy ignores what it does not use): action_dim, horizon, device, plus its own options; any
    other key must be one of the policy's options (ConfigError naming it and the valid keys)."""
    if is_export_dir(name):
        return load_exported(name, **kwargs)
    cls = policy_class(name)
    kwargs = check_options("policy_args", name, cls, kwargs, common=COMMON_KWARGS)   # old spellings renamed
    taken = option_names(cls)     # a common key the policy does not take is dropped here, not swallowed by it
    return cls(**{k: v for k, v in kwargs.items() if k in taken})
