"""Progress text of long runs (eval, record): rates so far and the time left at that rate."""

from __future__ import annotations

import threading
import time

from wamkit.core.durations import fmt_duration
from wamkit.core.lifecycle import StartClosingContext


def rate_text(done: int, env_steps: int | None, elapsed_s: float, remaining: int) -> str:
    """`12.3 steps/s 410 ep/h ETA 3m05s`: rates of this run (`done` episodes, `env_steps` steps in `elapsed_s`) and
    the time left for the `remaining` episodes at that rate; "" before the first episode."""
    if done <= 0 or elapsed_s <= 0:
        return ""
    eta = f"ETA {fmt_duration(remaining * elapsed_s / done)}" if remaining > 0 else "done"
    steps = f"{env_steps / elapsed_s:.1f} steps/s " if env_steps is not None else ""
    return f"{steps}{done / elapsed_s * 3600:.0f} ep/h {eta}"


class PlainProgress(StartClosingContext):
    """The progress of a run whose console is not a terminal (a log file, CI, `| tee`), where rich's bar would draw
    only once, at the end: a plain line every `every_s` seconds, and one at the end, e.g.
    `eval 12/40 episodes, success 7/12 (58%), 12.3 steps/s 410 ep/h ETA 4m06s, 1m45s elapsed`.
    The subset of rich.progress.Progress that the runner uses (add_task, update, `with`), for one task."""

    def __init__(self, console, every_s: float, label: str = "eval"):
        self.console, self.every_s, self.label = console, float(every_s), label
        self.fields: dict = {"total": 0, "completed": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def add_task(self, description: str, total: int, completed: int = 0, **fields) -> int:
        self.fields.update(fields, total=total, completed=completed)
        return 0

    def update(self, task_id: int, advance: int = 0, **fields) -> None:
        with self._lock:
            self.fields.update(fields)
            self.fields["completed"] += advance

    def line(self) -> str:
        with self._lock:
            f = dict(self.fields)
        parts = [f"{self.label} {f['completed']}/{f['total']} episodes"]
        if f.get("succ", "-") != "-":
            parts.append(f"success {f['succ']}")
        if f.get("rate"):
            parts.append(str(f["rate"]))
        parts.append(f"{fmt_duration(time.monotonic() - self._t0)} elapsed")
        return ", ".join(parts)

    def _print(self) -> None:
        self.console.print(self.line(), soft_wrap=True, markup=False, highlight=False)

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            self._print()

    def start(self) -> "PlainProgress":
        self._t0 = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._tick, name="eval-progress", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the timer and print the last line (once)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._print()
