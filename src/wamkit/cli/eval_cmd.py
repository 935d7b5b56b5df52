"""`wamkit eval [config.yaml] key=value ...`: evaluate a policy; writes OUT/results.jsonl, summary.json, report."""

from __future__ import annotations

from rich.console import Console

from wamkit.core.config import config_help, load_config, split_args
from wamkit.eval.config import EvalConfig


def names_footer() -> str:
    """Valid env and policy names (from the registries), for the help of eval-like verbs."""
    from wamkit.envs.base import env_names
    from wamkit.policies.registry import policy_names

    return (f"env: {' | '.join(env_names())}\n"
            f"policy: {' | '.join(policy_names())} | package.module:Class (your own: docs/models.md, \"Bring "
            f"your own model\") | a directory written by `wamkit export`\n"
            "example: wamkit eval env=libero suite=libero_object tasks=0,1 trials=2 policy=zero out=runs/x")


def help_text(argv: list[str]) -> str:
    return config_help(EvalConfig, "usage: wamkit eval [config.yaml] [key=value ...]", __doc__, names_footer())


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
