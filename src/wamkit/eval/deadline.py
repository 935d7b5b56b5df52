"""bench eval's `deadline_s`: start a row only if the bench can still finish it, and its bound, in time.

A bench whose command is killed at a time limit (the GPU machine's calls run under one) loses the row it was in
and its report: the medians, auto against the best fixed row, the bound. Session 23's 32-env call lost round 3's
auto row and the whole report that way, 40 s of device time. With deadline_s (seconds from the bench's start) a
row starts only if the time left holds it: its longest earlier round (else the longest row so far; the first row
always starts), plus the bound's runs where they come after the rows (the longest row again for the simulation
alone, twice with the contended one), plus MARGIN_S. When one does not fit, no later row starts: the report covers
the rounds every row finished (the rows of the round cut short are kept apart, `incomplete_round`), and the bound
is measured as asked.

Pure bookkeeping on the clock it is given (`now`), so tests drive it with a fake one."""

from __future__ import annotations

import time
from typing import Callable


class RowDeadline:
    MARGIN_S = 5.0

    def __init__(self, deadline_s: float | None, bound: bool | str = False,
                 now: Callable[[], float] = time.monotonic):
        self.deadline_s = deadline_s
        self.bound_rows = 0 if not bound else 2 if bound == "contended" else 1
        self.now = now
        self.t0 = now()
        self.took: dict[str, list[float]] = {}

    def elapsed(self) -> float:
        return self.now() - self.t0

    def record(self, row: str, seconds: float) -> None:
        self.took.setdefault(row, []).append(seconds)

    def _longest(self) -> float | None:
        """The longest row so far (None: nothing ran yet)."""
        return max((t for v in self.took.values() for t in v), default=None)

    def predicted(self, row: str) -> float | None:
        """Seconds the row is expected to take: its longest earlier round, else the longest row so far (None:
        nothing ran yet)."""
        own = self.took.get(row)
        return max(own) if own else self._longest()

    def needs(self, row: str) -> float | None:
        """Seconds the bench needs from now to finish the row and the bound after it (None: unknown yet)."""
        p = self.predicted(row)
        return None if p is None else p + self.bound_rows * self._longest() + self.MARGIN_S

    def allows(self, row: str) -> bool:
        """Whether the row may start: no deadline, nothing measured yet, or what it needs fits in what is left."""
        if self.deadline_s is None:
            return True
        need = self.needs(row)
        return need is None or self.elapsed() + need <= self.deadline_s
