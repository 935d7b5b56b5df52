"""Training checkpoint -> servable directory, in one step and one process (no FSDP, no process group).

The policy is rebuilt from the checkpoint's policy.json (the policy manifest, `wamkit.policies.manifest`), the (EMA
by default) weights are read from the sharded safetensors of the checkpoint (any number of ranks wrote them), the
action pipeline with its normalizer stats is attached, and `wamkit.policies.export.save_exported` writes the
directory `make_policy(dir)` loads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from wamkit.core.errors import UserError
from wamkit.policies.manifest import CHECKPOINT_MANIFEST, EXPORT_MARKER, PolicyManifest, is_export_dir
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


def check_export_out(out: Path, ckpt: Path) -> None:
    """OUT is new, empty, or an earlier export (replaced whole); never a checkpoint, a dataset or any other
    directory with files in it (they were written into, and old files stayed)."""
    if out.exists() and not out.is_dir():       # was a FileExistsError traceback after the policy was loaded
        raise UserError(f"export OUT {out} exists and is not a directory")
    o, c = out.resolve(), ckpt.resolve()
    if o == c or c in o.parents or o in c.parents:
        raise UserError(f"export OUT {out} is the checkpoint {ckpt}, inside it or above it: choose another directory")
    if out.is_dir() and any(out.iterdir()) and not is_export_dir(out):
        raise UserError(f"export OUT {out} is not empty and holds no earlier export ({EXPORT_MARKER}): choose an "
                        f"empty or new directory")


def export_checkpoint(ckpt: str | Path, out: str | Path, weights: str = "auto") -> Path:
    """Write the export into a temporary sibling of OUT, then put it in OUT's place: a kill leaves the earlier
    export (or nothing) in OUT, never an old manifest beside new, partial weights."""
    from wamkit.policies.export import save_exported

    out = Path(out)
    check_export_out(out, Path(ckpt))
    policy, which, step_dir = load_trained_policy(ckpt, weights)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        save_exported(policy, tmp)
        (tmp / "wamkit_train_source.json").write_text(json.dumps({"checkpoint": str(step_dir.resolve()),
                                                                  "weights": which}, indent=1))
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
