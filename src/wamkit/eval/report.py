"""Human-readable views of an evaluation output directory: the per-task table, the timeline picture, report.md and
report.html (see report_html)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from wamkit.core.files import write_atomic
from wamkit.eval.metrics import load_summary  # noqa: F401  (the results contract; kept importable from here)
from wamkit.eval.metrics import chunk_ms_text, task_chunk_ms
from wamkit.eval.timeline import batch_sizes_summary


def task_table(summary: dict) -> Table:
    t = Table(title=f"success {summary['successes']}/{summary['episodes']} = {summary['success_rate']:.1%}")
    # (each task's chunk ms is in report.md and report.html, and the range under this table: a seventh column
    # squeezed the task names and headers of an 80-column terminal)
    for c in ("task_id", "task", "episodes", "successes", "success rate", "mean steps"):
        t.add_column(c, justify="right" if c not in ("task",) else "left")
    for tid, row in summary["per_task"].items():
        t.add_row(tid, row.get("task", "")[:60], str(row["episodes"]), str(row["successes"]),
                  f"{row['success_rate']:.1%}", f"{row.get('mean_steps', 0):.0f}")
    return t


def pace_line(summary: dict) -> str | None:
    """How far apart the tasks' paces are (their mean chunks), where the run has two tasks or more with one."""
    paced = [(ms, row.get("task") or tid) for tid, row in summary["per_task"].items()
             if (ms := task_chunk_ms(row)) is not None and ms > 0]
    if len(paced) < 2:
        return None
    (lo, lo_task), (hi, hi_task) = min(paced), max(paced)
    return (f"Task pace: a chunk took {lo:.1f} ms ({lo_task}) to {hi:.1f} ms ({hi_task}), {hi / lo:.2f}x; a request "
            f"that waits for every env of a group waits for its slowest task's chunk")


def throughput_line(summary: dict) -> str:
    th = summary["throughput"]
    return (f"{th['episodes_this_run']} episodes in {th['wall_s']:.1f} s: {th['episodes_per_hour']:.0f} episodes/h, "
            f"{th['env_steps_per_s']:.1f} env steps/s, {th['inference_obs_per_s']:.1f} inference obs/s")


def table_markdown(summary: dict) -> str:
    lines = ["| task_id | task | episodes | successes | success rate | chunk ms |", "|---|---|---|---|---|---|"]
    for tid, row in summary["per_task"].items():
        task = str(row.get("task", "")).replace("|", "\\|")   # a | in a task name would end the cell
        lines.append(f"| {tid} | {task} | {row['episodes']} | {row['successes']} | "
                     f"{row['success_rate']:.1%} | {chunk_ms_text(row)} |")
    lines.append(f"| all | | {summary['episodes']} | {summary['successes']} | {summary['success_rate']:.1%} | |")
    return "\n".join(lines) + "\n"


def utilization(out: str | Path, summary: dict) -> dict | None:
    """env_busy / inference_busy / mean_batch of a run: the summary's, else measured from OUT/timeline.json."""
    sch = summary.get("scheduler", {})
    if all(isinstance(sch.get(k), (int, float)) for k in ("env_busy", "inference_busy")):
        keys = ("env_busy", "inference_busy", "mean_batch", "sim_ms_mean", "env_wait_ms_mean", "request_ms_mean",
                *WORKER_MS_KEYS, "server_batches")
        return {k: sch[k] for k in keys if sch.get(k) is not None}
    tl = readable_timeline(out)
    return tl.utilization() if tl is not None else None


def timeline_problem(out: str | Path) -> str | None:
    """Why OUT/timeline.json cannot be read (a run killed while writing it, with an older version), or None."""
    from wamkit.core.errors import UserError
    from wamkit.eval.timeline import Timeline

    tl = Path(out) / "timeline.json"
    try:
        if tl.exists():
            Timeline.load(tl)
    except UserError as e:
        return str(e)
    return None


def readable_timeline(out: str | Path):
    """OUT/timeline.json as a Timeline; None where there is none or it cannot be read (the report goes on without
    it: print_report says why once)."""
    from wamkit.core.errors import UserError
    from wamkit.eval.timeline import Timeline

    tl = Path(out) / "timeline.json"
    try:
        return Timeline.load(tl) if tl.exists() else None
    except UserError:
        return None


WORKER_MS_KEYS = ("sim_worker_ms_mean", "cpu_worker_ms_mean", "render_worker_ms_mean")   # chunk_text's arguments


def chunk_text(sim_ms: float, worker_ms: float | None, cpu_ms: float | None = None,
               render_ms: float | None = None) -> str:
    """An env's mean chunk as the evaluating process saw it, with the env process's own part where the run has it
    (summary `sim_worker_ms_mean`) and of that its CPU time and camera rendering (`cpu_worker_ms_mean`,
    `render_worker_ms_mean`): 'chunk 18.7', 'chunk 18.7 (in the env's process 16.2: CPU 15.8, rendering 4.1)'."""
    if not worker_ms:
        return f"chunk {sim_ms:.1f}"
    parts = [f"{name} {ms:.1f}" for name, ms in (("CPU", cpu_ms), ("rendering", render_ms)) if ms is not None]
    return f"chunk {sim_ms:.1f} (in the env's process {worker_ms:.1f}" + (f": {', '.join(parts)})" if parts else ")")


def utilization_line(u: dict) -> str:
    """The run's utilization, and where an env's cycle went (timeline.env_cycle) when the run recorded it."""
    line = (f"env busy {u['env_busy']:.0%} of env time, inference busy {u['inference_busy']:.0%} of wall time, "
            f"mean batch {u.get('mean_batch', 0.0):.1f}")
    if u.get("sim_ms_mean"):
        line += (f"; an env's cycle {u['sim_ms_mean'] + u.get('env_wait_ms_mean', 0.0):.1f} ms = "
                 f"{chunk_text(u['sim_ms_mean'], *(u.get(k) for k in WORKER_MS_KEYS))} + waiting "
                 f"{u.get('env_wait_ms_mean', 0.0):.1f} for actions (request {u.get('request_ms_mean', 0.0):.1f})")
    batches = batch_sizes_summary(u.get("server_batches"))
    if batches:   # what the model ran: requests merged by the server (summary.scheduler.server_batches)
        n, mean, lo, hi = batches
        line += f"; the server ran {n} batches of {mean:.1f} observations on average ({lo}-{hi})"
    return line


def draw_timeline(out: str | Path) -> Path | None:
    """OUT/timeline.png from OUT/timeline.json (redrawn only when the JSON is newer); None without a timeline."""
    tl, png = Path(out) / "timeline.json", Path(out) / "timeline.png"
    if not tl.exists():
        return None
    if not png.exists() or png.stat().st_mtime < tl.stat().st_mtime:
        timeline = readable_timeline(out)
        if timeline is None:   # a picture older than the JSON shows some other timeline: not embedded as this one
            png.unlink(missing_ok=True)
            return None
        timeline.draw(png)
    return png


def report_markdown(out: str | Path, summary: dict) -> str:
    parts = [table_markdown(summary), throughput_line(summary) + "\n"]
    u = utilization(out, summary)
    if u is not None:
        parts.append(f"Utilization: {utilization_line(u)}.\n")
    if (pace := pace_line(summary)) is not None:
        parts.append(f"{pace}.\n")
    if (Path(out) / "timeline.png").exists():
        parts.append("![timeline: one lane per env and inference side](timeline.png)\n")
    parts.append("All on one page (table, chart, episode videos, timeline, config): [report.html](report.html)\n")
    return "\n".join(parts)


def write_report(out: str | Path) -> dict:
    """Write OUT/timeline.png, OUT/report.md and OUT/report.html; returns the summary."""
    from wamkit.eval.report_html import write_html

    s = load_summary(out)
    draw_timeline(out)
    write_atomic(Path(out) / "report.md", report_markdown(out, s))
    write_html(out)
    return s


def print_report(out: str | Path, console: Console | None = None) -> dict:
    """Print the per-task table, throughput and utilization, and (re)write the report files."""
    console = console or Console()
    s = write_report(out)
    if (why := timeline_problem(out)) is not None:
        console.print(f"warning: {why}; the report goes on without it", soft_wrap=True)
    console.print(task_table(s))
    console.print(throughput_line(s))
    u = utilization(out, s)
    png = Path(out) / "timeline.png"
    if u is not None:
        console.print(f"timeline: {png if png.exists() else '-'}  {utilization_line(u)}")
    if (pace := pace_line(s)) is not None:
        console.print(pace)
    console.print(f"report: {Path(out) / 'report.html'}")
    return s
