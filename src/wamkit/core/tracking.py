"""Optional experiment tracking (`logger=wandb` in train and eval): Weights & Biases when the package is installed
(`pip install -e ".[wandb]"`). Runs write under OUT/wandb; WANDB_MODE=offline needs no account (`wandb sync` later)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from wamkit.core.errors import UserError
from wamkit.core.secrets import redact


def require_wandb() -> None:
    """logger=wandb without the package is a user error (one line), raised before any work starts."""
    if importlib.util.find_spec("wandb") is None:
        raise UserError("logger=wandb needs the wandb package: pip install wandb (or the [wandb] extra)")


def start_wandb(project: str, out: str | Path, config: dict[str, Any], job_type: str):
    """A W&B run named after the out= dir, its files under OUT/wandb; `config` is logged with its secrets redacted
    (core/secrets.py)."""
    require_wandb()
    import wandb

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(project=project, name=out.resolve().name, dir=str(out), config=redact(config),
                      job_type=job_type, reinit="finish_previous")
