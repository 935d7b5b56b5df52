"""`wamkit eval [config.yaml] key=value ...`: evaluate a policy; writes OUT/results.jsonl, summary.json, report."""

from __future__ import annotations

from rich.console import Console

from wamkit.core.config import split_args
from wamkit.core.config import load_config
from wamkit.eval.config import EvalConfig


def main(argv: list[str]) -> int:
    path, overrides = split_args(argv)
    cfg = load_config(EvalConfig, path, overrides)
    from wamkit.eval.report import print_report
    from wamkit.eval.runner import run_eval
    from wamkit.runtime import eval_runtime

    console = Console()
    run_eval(cfg, console=Console(stderr=True), **eval_runtime(cfg))
    print_report(cfg.out, console)
    return 0
