"""Policies by name: `make_policy(name_or_target_or_export_dir, **kwargs)`. Names and `package.module:Class` targets
resolve in `catalog.py`; a directory written by `wamkit export` (it holds `wamkit_policy.json`, see `manifest.py`) is
also a valid policy name."""

from __future__ import annotations

from wamkit.policies.base import Policy
from wamkit.policies.catalog import (COMMON_KWARGS, check_policy_args, construct, is_import_target,  # noqa: F401
                                     policy_class, policy_names, policy_target, register_policy)
from wamkit.policies.export import load_exported
from wamkit.policies.manifest import EXPORT_MARKER, is_export_dir  # noqa: F401


def make_policy(name: str, **kwargs) -> Policy:
    """Build a policy by registered name, `package.module:Class`, or from an exported directory.

    Common kwargs (each policy ignores what it does not use): action_dim, horizon, device, plus its own options; any
    other key must be one of the policy's options (ConfigError naming it and the valid keys). The class and the
    built policy are checked (catalog.check_policy_class, catalog.check_built): a mistake is one line."""
    if is_export_dir(name):
        return load_exported(name, **kwargs)
    return construct(policy_class(name), name, kwargs)


def check_args(name: str, policy_args: dict) -> None:
    """A policy's name and options checked before anything is built or started (unknown name or class, unknown
    key, bad value: one line). An export directory's options are checked when it is loaded."""
    if not is_export_dir(name):
        check_policy_args(name, policy_class(name), dict(policy_args))
