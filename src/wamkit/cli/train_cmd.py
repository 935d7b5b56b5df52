"""`wamkit train [train.yaml] [key=value ...]`: fine-tune a policy (see docs/training.md).

nproc=N (N > 1) relaunches this command under torch.distributed.run with N processes; under torchrun already,
the world size comes from torchrun."""

from __future__ import annotations

import json
import os

from wamkit.core.config import split_args
from wamkit.core.config import load_config


def main(argv: list[str]) -> int:
    from wamkit.train.config import TrainConfig
    from wamkit.train.dist import relaunch_under_torchrun, under_torchrun

    path, overrides = split_args(argv)
    cfg = load_config(TrainConfig, path, overrides)
    if cfg.nproc > 1 and not under_torchrun():
        return relaunch_under_torchrun(cfg.nproc, argv)
    from wamkit.train.trainer import train

    summary = train(cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({k: summary[k] for k in ("steps", "world_size", "checkpoint", "last")}, default=str))
    return 0
