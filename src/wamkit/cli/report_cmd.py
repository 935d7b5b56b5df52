"""`wamkit report OUT`: print the per-task table, throughput and utilization of an evaluation and (re)write its
report files: OUT/timeline.png, OUT/report.md and OUT/report.html (one self-contained page with the videos)."""

from __future__ import annotations

from wamkit.core.errors import UserError


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise UserError("usage: wamkit report OUT_DIR")
    from wamkit.eval.report import print_report

    print_report(argv[0])
    return 0
