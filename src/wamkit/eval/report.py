"""Human-readable views of an evaluation output directory: the per-task table and the timeline picture."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from wamkit.core.errors import UserError


def load_summary(out: str | Path) -> dict:
    p = Path(out) / "summary.json"
    if not p.exists():
        raise UserError(f"no summary.json in {out} (is it an evaluation output directory?)")
    return json.loads(p.read_text())


def task_table(summary: dict) -> Table:
    t = Table(title=f"success {summary['successes']}/{summary['episodes']} = {summary['success_rate']:.1%}")
    for c in ("task_id", "task", "episodes", "successes", "success rate", "mean steps"):
        t.add_column(c, justify="right" if c not in ("task",) else "left")
    for tid, row in summary["per_task"].items():
        t.add_row(tid, row.get("task", "")[:60], str(row["episodes"]), str(row["successes"]),
                  f"{row['success_rate']:.1%}", f"{row.get('mean_steps', 0):.0f}")
    return t


def throughput_line(summary: dict) -> str:
    th = summary["throughput"]
    return (f"{th['episodes_this_run']} episodes in {th['wall_s']:.1f} s: {th['episodes_per_hour']:.0f} episodes/h, "
            f"{th['env_steps_per_s']:.1f} env steps/s, {th['inference_obs_per_s']:.1f} inference obs/s")


def table_markdown(summary: dict) -> str:
    lines = ["| task_id | task | episodes | successes | success rate |", "|---|---|---|---|---|"]
    for tid, row in summary["per_task"].items():
        lines.append(f"| {tid} | {row.get('task', '')} | {row['episodes']} | {row['successes']} | "
                     f"{row['success_rate']:.1%} |")
    lines.append(f"| all | | {summary['episodes']} | {summary['successes']} | {summary['success_rate']:.1%} |")
    return "\n".join(lines) + "\n"


def print_report(out: str | Path, console: Console | None = None) -> dict:
    console = console or Console()
    s = load_summary(out)
    console.print(task_table(s))
    console.print(throughput_line(s))
    md = table_markdown(s) + "\n" + throughput_line(s) + "\n"
    tl = Path(out) / "timeline.json"
    if tl.exists():
        from wamkit.eval.timeline import Timeline

        timeline = Timeline.load(tl)
        png = timeline.draw(Path(out) / "timeline.png")
        u = timeline.utilization()
        util = (f"env busy {u['env_busy']:.0%} of env time, inference busy {u['inference_busy']:.0%} of wall time")
        console.print(f"timeline: {png}  {util}")
        md += (f"\nUtilization: {util}.\n\n"
               f"![timeline: when each env simulated and when inference ran]({Path(png).name})\n")
    (Path(out) / "report.md").write_text(md)
    return s
