"""Training logs (rank 0 only): TensorBoard scalars under OUT/tb, OUT/train_log.jsonl (one JSON line per log step),
on the console a rich progress bar (step, loss, steps/s) when stdout is a terminal and progress=true, otherwise one
plain line per log window (`progress_line`: nohup, Slurm, CI logs, where the bar drew nothing until the end), and with
logger=wandb a Weights & Biases run (files under OUT/wandb;
WANDB_MODE=offline keeps it local, `wandb sync OUT/wandb/offline-run-*` uploads it later)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from wamkit.core.durations import fmt_duration
from wamkit.core.files import write_atomic


def truncate_log(path: Path, last_step: int) -> int:
    """Keep only the rows of `path` (train_log.jsonl) with step <= last_step, rewritten atomically; returns how many
    were dropped. A run killed after its last checkpoint logged steps past it, which a resume logs again: without
    this every such step was in the log twice. Also drops a torn (half-written) last line of a killed run."""
    keep: list[str] = []
    dropped = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
                ok = int(row["step"]) <= last_step
            except (ValueError, KeyError, TypeError):    # torn or foreign line
                ok = False
            if ok:
                keep.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += bool(line.strip())
    if not dropped:
        return 0
    write_atomic(path, "".join(keep), fsync=True)   # a kill leaves the old log or the new one, never half of one
    return dropped


def after_earlier_event_files(tb: Path) -> None:
    """Wait (under a second) until this second is past the creation second of tb/'s event files. TensorBoard reads
    a run's event files in name order, and a name starts with its writer's creation second then ends with a counter:
    a writer created in the same second as the last one can sort before it ('.10' before '.9'), and the purge of
    the earlier run's steps past the checkpoint is then read first and applies to nothing (each such step shown
    twice; seen in a test that resumes within the second)."""
    stamps = []
    for p in tb.glob("events.out.tfevents.*"):
        parts = p.name.split(".")
        if len(parts) > 3 and parts[3].isdigit():
            stamps.append(int(parts[3]))
    if stamps:
        wait = max(stamps) + 1 - time.time()
        if 0 < wait <= 1:
            time.sleep(wait)


def progress_line(step: int, total: int, scalars: dict[str, float]) -> str:
    """The console line of a log window without the bar, e.g.
    `train step 40/2000 | loss 0.4121 | 3.52 steps/s | 112.6 samples/s | ETA 9m17s` (ETA at the window's rate)."""
    parts = [f"train step {step}/{total}"]
    if "loss" in scalars:
        parts.append(f"loss {scalars['loss']:.4f}")
    sps = scalars.get("steps_per_s")
    if sps is not None:
        parts.append(f"{sps:.2f} steps/s")
    if "samples_per_s" in scalars:
        parts.append(f"{scalars['samples_per_s']:.1f} samples/s")
    if sps and sps > 0 and step < total:
        parts.append(f"ETA {fmt_duration((total - step) / sps)}")
    return " | ".join(parts)


class TrainLogger:
    def __init__(self, out: str | Path, enabled: bool, total_steps: int, start_step: int, progress: bool = True,
                 wandb_project: str | None = None, config: dict | None = None):
        self.enabled = enabled
        self._tb = self._jsonl = self._progress = self._wandb = None
        if not enabled:
            return
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        from torch.utils.tensorboard import SummaryWriter

        log_path = out / "train_log.jsonl"
        earlier = log_path.exists() or (out / "tb").is_dir()
        if log_path.exists():
            truncate_log(log_path, start_step)
        self._jsonl = open(log_path, "a", buffering=1)   # first: the file that marks out= as a run dir (is_run_dir)
        # purge_step: TensorBoard drops the earlier run's events from this step on (those after the checkpoint
        # resumed from, or all of them on a restart from step 0), so a resumed run shows each step once
        if earlier:
            after_earlier_event_files(out / "tb")
        self._tb = SummaryWriter(str(out / "tb"), purge_step=start_step + 1 if earlier else None)
        if wandb_project:
            from wamkit.core.tracking import start_wandb

            self._wandb = start_wandb(wandb_project, out, config or {}, job_type="train")
        self._total = total_steps
        if progress and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[sps]} steps/s"),
                                      TimeRemainingColumn(), transient=False,
                                      auto_refresh=False)   # redrawn per log window: no 10 Hz render thread taking
                                                            # the GIL from the training loop between them
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, loss="-", sps="-")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        for k, v in scalars.items():
            self._tb.add_scalar(f"train/{k}", v, step)
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **scalars}) + "\n")
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in scalars.items()}, step=step)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{scalars.get('loss', float('nan')):.4f}",
                                  sps=f"{scalars.get('steps_per_s', float('nan')):.2f}", refresh=True)
        else:
            print(progress_line(step, self._total, scalars), flush=True)

    def text(self, msg: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(msg, soft_wrap=True, markup=False, highlight=False)   # one line, as given
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        self._tb.flush()
        self._tb.close()
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()

