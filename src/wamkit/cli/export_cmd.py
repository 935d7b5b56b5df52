"""`wamkit export CKPT OUT [weights=auto|ema|model]`: training checkpoint -> directory that `wamkit serve policy=OUT`
and `wamkit eval policy=OUT` load. CKPT: a step dir, a run's checkpoints/ dir or a run dir (newest checkpoint)."""

from __future__ import annotations

from wamkit.core.errors import UserError


USAGE = "usage: wamkit export CKPT_DIR OUT_DIR [weights=auto|ema|model]"


def help_text(argv: list[str]) -> str:
    return (f"{USAGE}\n\n{__doc__.strip()}\n\nweights=auto  [auto|ema|model] auto: the EMA weights when the run "
            "kept them (ema > 0), else the model's")


def main(argv: list[str]) -> int:
    from wamkit.train.export import export_checkpoint

    pos = [a for a in argv if "=" not in a]
    kv = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(kv) - {"weights"}
    if len(pos) != 2 or unknown:
        raise UserError(USAGE)
    out = export_checkpoint(pos[0], pos[1], weights=kv.get("weights", "auto"))
    print(f"exported {pos[0]} -> {out}")
    return 0
