"""Training checkpoint -> servable directory, in one step and one process (no FSDP, no process group).

The policy is rebuilt from the checkpoint's policy.json (the policy manifest, `wamkit.policies.manifest`), the (EMA
by default) weights are read from the sharded safetensors of the checkpoint (any number of ranks wrote them), the
action pipeline with its normalizer stats is attached, and `wamkit.policies.export.save_exported` writes the
directory `make_policy(dir)` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from wamkit.core.errors import UserError
from wamkit.policies.manifest import CHECKPOINT_MANIFEST, PolicyManifest
from wamkit.train.checkpoint import load_weights_into, resolve_checkpoint


def load_trained_policy(ckpt: str | Path, weights: str = "auto", device: str = "cpu"):
    """(policy with the checkpoint's weights and action pipeline, which weights were loaded, step dir)."""
    from wamkit.data.transforms import ActionPipeline
    from wamkit.train.trainer import build_policy

    step_dir = resolve_checkpoint(ckpt)
    meta_file = step_dir / CHECKPOINT_MANIFEST
    if not meta_file.exists():
        raise UserError(f"{step_dir} has no {CHECKPOINT_MANIFEST} (not written by wamkit train?)")
    meta = PolicyManifest.read(meta_file)
    pipe = ActionPipeline.load(step_dir / meta.files.get("action_pipeline", "action_pipeline.json"))
    args = dict(meta.config)
    args["device"] = device
    args["action_pipeline"] = pipe            # the trained pipeline (with its stats), as load_exported passes it
    policy = build_policy(meta.policy, args)
    policy.action_pipeline = pipe
    which = load_weights_into(policy.module, step_dir, weights)
    policy.module.eval()
    return policy, which, step_dir


def export_checkpoint(ckpt: str | Path, out: str | Path, weights: str = "auto") -> Path:
    from wamkit.policies.export import save_exported

    out = Path(out)
    if out.exists() and not out.is_dir():       # was a FileExistsError traceback after the policy was loaded
        raise UserError(f"export OUT {out} exists and is not a directory")
    policy, which, step_dir = load_trained_policy(ckpt, weights)
    save_exported(policy, out)
    (out / "wamkit_train_source.json").write_text(json.dumps({"checkpoint": str(step_dir.resolve()),
                                                              "weights": which}, indent=1))
    return out
