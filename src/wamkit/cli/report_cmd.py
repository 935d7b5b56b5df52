"""`wamkit report OUT`: the per-task table, throughput, and the timeline PNG of an evaluation."""

from __future__ import annotations

from wamkit.core.errors import UserError


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise UserError("usage: wamkit report OUT_DIR")
    from wamkit.eval.report import print_report

    print_report(argv[0])
    return 0
