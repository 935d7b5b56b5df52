"""`wamkit train [train.yaml] [key=value ...]`: fine-tune a policy (see docs/training.md).

An out= that already holds a run is refused unless resume=true (continue it) or overwrite=true (replace it).

nproc=N (N > 1) relaunches this command under torch.distributed.run with N processes; under torchrun already,
the world size comes from torchrun."""

from __future__ import annotations

import json
import os

from wamkit.core.config import config_help, load_config, split_args


def help_text(argv: list[str]) -> str:
    from wamkit.train.config import TrainConfig

    return config_help(TrainConfig, "usage: wamkit train [train.yaml] [key=value ...]", __doc__,
                       "example: wamkit train policy=wam-ref policy_args.size=tiny dataset=runs/demos fps=80 "
                       "steps=300 out=runs/train")


def main(argv: list[str]) -> int:
    from wamkit.train.config import TrainConfig
    from wamkit.train.dist import relaunch_under_torchrun, under_torchrun

    path, overrides = split_args(argv)
    cfg = load_config(TrainConfig, path, overrides)
    from wamkit.train.trainer import RESUME_WARNED, check_out_dir, train

    check_out_dir(cfg)          # one line here, not one per rank
    if cfg.nproc > 1 and not under_torchrun():
        os.environ[RESUME_WARNED] = "1"   # its warnings were printed here: the ranks do not print them again
        return relaunch_under_torchrun(cfg.nproc, argv)

    summary = train(cfg, out_checked=True)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({k: summary[k] for k in ("steps", "world_size", "checkpoint", "last")}, default=str))
    return 143 if summary.get("stopped") == "SIGTERM" else 0   # stopped by SIGTERM, its checkpoint written
