"""The policy manifest: one JSON format saying which policy a directory holds and how to rebuild it.

    {"format": "wamkit.policy", "version": 1, "policy": <registry name or package.module:Class>,
     "config": <constructor kwargs>, "spec": <PolicySpec.to_dict()>, "files": {<role>: <relative path>}}

Two places write it: an export directory (`wamkit_policy.json`, EXPORT_MARKER: a directory holding it is a policy
name for make_policy, `wamkit eval policy=<dir>` and `wamkit serve policy=<dir>`) and every training checkpoint
(`policy.json`: the run's policy and policy_args, what `wamkit export` rebuilds the policy from). Checkpoints written
before this format ({"policy", "policy_args", "spec"}) still read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from wamkit.core.errors import UserError

FORMAT = "wamkit.policy"
VERSION = 1
EXPORT_MARKER = "wamkit_policy.json"     # in an export directory
CHECKPOINT_MANIFEST = "policy.json"      # in a training checkpoint's step directory


@dataclass
class PolicyManifest:
    policy: str                                         # registry name (or package.module:Class)
    config: dict[str, Any] = field(default_factory=dict)  # constructor kwargs
    spec: dict[str, Any] = field(default_factory=dict)    # PolicySpec.to_dict()
    files: dict[str, str] = field(default_factory=dict)   # role (weights, action_pipeline, ...) -> relative path
    format: str = FORMAT
    version: int = VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"format": d.pop("format"), "version": d.pop("version"), **d}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=str))
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | Path = "manifest") -> "PolicyManifest":
        if not isinstance(d, dict):
            raise UserError(f"{source}: expected a JSON object, got a {type(d).__name__}")
        if "format" not in d and "policy_args" in d:   # a checkpoint's policy.json before this format
            return cls(policy=d["policy"], config=dict(d.get("policy_args") or {}), spec=dict(d.get("spec") or {}))
        if d.get("format") != FORMAT:
            raise UserError(f"{source}: unknown format {d.get('format')!r} (expected {FORMAT!r})")
        if int(d.get("version", 0)) > VERSION:
            raise UserError(f"{source}: format version {d['version']} is newer than this wamkit reads ({VERSION})")
        if "policy" not in d:
            raise UserError(f"{source}: no `policy` field")
        return cls(policy=d["policy"], config=dict(d.get("config") or {}), spec=dict(d.get("spec") or {}),
                   files=dict(d.get("files") or {}), version=int(d.get("version", VERSION)))

    @classmethod
    def read(cls, path: str | Path) -> "PolicyManifest":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path} does not exist") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d, path)


def is_export_dir(path: str | Path) -> bool:
    """Whether `path` is a directory written by `wamkit export` / `save_pretrained` (a valid policy name)."""
    return (Path(path) / EXPORT_MARKER).exists()


def read_export_manifest(directory: str | Path) -> PolicyManifest:
    d = Path(directory)
    if not is_export_dir(d):
        raise UserError(f"{d} is not an export directory (no {EXPORT_MARKER})")
    return PolicyManifest.read(d / EXPORT_MARKER)
