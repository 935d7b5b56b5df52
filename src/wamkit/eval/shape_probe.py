"""auto's measured choice of request shape: the cost model's plan, every observation sent at once (a request each),
every env's observation in one request, or two requests of half the envs each.

The RequestPlanner's cost model (scheduler.py) picks a batch size and a number of requests in flight from measured
chunk and call times. It cannot see everything that decides the rate on a real machine: a server that merges
concurrent requests into one batch (`wamkit serve`, SGLang), envs whose tasks simulate at different speeds (a cohort
waits for its slowest member), a server process slowed by the simulators around it. On the H200 (docs/benchmarks.md
2) the model's plan lost 14-17% to the row that sends every observation as soon as it is ready and lets the server
batch, while on other regimes the model's plan is the better one, and on one H200 the lockstep row (every env in one
request, the reference's B = envs, P = 1) beat both by 8%. Where a call costs about as much as a chunk and little
more for more observations (session 10's H200 MetaWorld: ~22 ms each), two half-size requests overlap one half's
simulation with the other half's inference: the fixed row of that shape (B = envs / 2, P = 2) is the best of the
grid on that regime's model (bench/planner_sim.py gpu-metaworld-16-s10), and the cost model, which counts every
call's transport as accelerator time, ranks it no better than lockstep. So auto measures: for a few env cycles
each it runs the four shapes, counts the observations answered per second, keeps the fastest, and measures again
when the number of active envs falls well below what it was (the tail of a run) or after a while. Where the two
fastest come within CLOSE of each other, one window each cannot tell them apart (on the H100 in session 13 greedy
beat halves by 1.4% in the probe, while the fixed rows of those shapes differed by 5.5% the other way), so a *duel*
follows: the two alternate for DUEL_LEGS more windows, and the one with the higher rate over all its windows is kept.
It costs little: the shapes are within CLOSE of each other. How close is close comes from the real rows' own
noise: in session 20's 16-env H100 rows, one shape's rate over a window of 0.4 s (this probe's usual window there)
varied with a coefficient of variation of 7-11% along a row, and still 5-10% over 2 s windows (episode resets come in
waves). Two single windows therefore cannot rank shapes 10% apart: that round measured halves at 420.6 obs/s and
greedy at 391.1 (7% apart: no duel when CLOSE was 0.05), and kept halves, whose fixed row then ran at 358.9 against
greedy's 391.1. So a duel now follows whenever the two fastest are within 15%, over 8 windows (five per shape with
the round's): at that noise ~4% per shape if the windows were independent, less well where slow waves span
several of them (one call on an H100 in session 20: the duel reversed the round's order and auto ran at 0.990 of
the best fixed row, against 0.956 the call before, on another card).

A round's windows are short, and a transient (the host slowing for a second or two) can fall in some of them: on the
H100 in session 16, one round measured lockstep and halves ~40% below their other rounds (both cut short by the
early stop) and kept the plan at 477 obs/s, which then ran at ~400 for the rest of the row, 15% behind the halves
row. So a decision is *checked*: the kept shape's next window (it runs anyway: no cost but its settling) is
compared with the rate it was kept for. Where it falls more than CHECK_DROP below and a rival's window had been cut
short, the round's figures no longer describe the run: every shape is measured again at once (one such round per
decision: its own decision is not checked again). Both conditions, not the first alone: on the planner model of
session 16's 32-env rows with a 1 s slowdown (x1.5 or x2) starting at 10 places between 1.5 and 6 s
(bench/bench_planner.py --transients), auto ran at 0.9393 of the halves row without a check, 0.9345 with a recheck
on the drop alone (set off by slowdowns in the check window itself), and 0.9404 with both conditions, which never
lost and won 2.4 points where it fired.

Pure bookkeeping: every method takes the time it is told (`now`, monotonic seconds), so the same code runs on the
real clock and on the planner model's virtual one (bench/planner_sim.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

PLAN, GREEDY, LOCKSTEP, HALVES = "plan", "greedy", "lockstep", "halves"
SHAPES = (PLAN, GREEDY, LOCKSTEP, HALVES)

Cost = Union[float, None, Callable[[], Optional[float]]]   # a figure, or a function that computes it when asked


def _value(x: Cost) -> float | None:
    return x() if callable(x) else x


@dataclass
class ProbeRound:
    """One measurement of every shape: when it ended (the caller's clock: seconds since the run started), with how
    many active envs, each shape's observations answered per second, and the shape kept."""

    at_s: float
    active: int
    rates: dict[str, float] = field(default_factory=dict)
    chosen: str = PLAN
    duel: dict[str, float] = field(default_factory=dict)   # a close call: the two fastest over all their windows
    check: float | None = None   # the kept shape's rate in its window after the decision (None: not checked)
    recheck: bool = False        # this round was started by the previous round's failed check

    @property
    def kept_rate(self) -> float:
        """The rate the chosen shape was kept for: its duel rate after a duel, else its round window's."""
        return self.duel.get(self.chosen, self.rates.get(self.chosen, 0.0))

    def as_dict(self) -> dict:
        d = {"at_s": round(self.at_s, 3), "active": self.active,
             "rates_obs_per_s": {k: round(v, 2) for k, v in self.rates.items()}, "chosen": self.chosen}
        if self.duel:
            d["duel_obs_per_s"] = {k: round(v, 2) for k, v in self.duel.items()}
        if self.check is not None:
            d["check_obs_per_s"] = round(self.check, 2)
        if self.recheck:
            d["recheck"] = True
        return d


class ShapeProbe:
    """Which shape the planner uses now, measured as described in the module's docstring.

    A shape's window starts SETTLE_CYCLES env cycles after the switch (requests sent under the other shape drain
    first) and lasts WINDOW_CYCLES cycles, at least MIN_WINDOW_S. The rate counts from the first answer after the
    window opens to the first answer after it closes (whole answers at both ends: a shape that answers in large
    lumps is not favoured or penalized by where a lump falls)."""

    SETTLE_CYCLES = 2.0
    WINDOW_CYCLES = 8.0
    MIN_WINDOW_S = 0.4
    EARLY_STOP = 0.7          # a shape this far below the best measured so far, a quarter into its window, stops
    WARM_ANSWERS = 2          # x active envs: observations answered before the first measurement (calls measured)
    REPROBE_ACTIVE = 0.75     # measure again once active envs fall below this share of those at the last round
    REPROBE_S = 120.0         # ... or this long after it
    MAX_SHARE = 0.15          # a round starts only if it costs at most this share of the run's predicted rest
    CLOSE = 0.15              # the two fastest this close: a duel decides (if it costs at most MAX_SHARE too)
    DUEL_LEGS = 8             # ... of this many more windows, the two shapes alternating
    CHECK_DROP = 0.10         # the kept shape's next window this far below its kept rate (and a rival cut short by
                              # the early stop): measure every shape again
    CHECK_NEEDS_CUT = True    # False: the drop alone sets off the recheck (bench_planner.py --transients compares)

    def __init__(self, shapes: tuple[str, ...] = SHAPES):
        self.shapes = tuple(shapes)
        self.current = self.shapes[0]
        self.rounds: list[ProbeRound] = []
        self._answered = 0
        self._order: list[str] = []        # shapes still to measure in this round (current first)
        self._rates: dict[str, float] = {}
        self._pooled: dict[str, list[float]] = {}   # shape -> [observations, seconds] over this round's windows
        self._dueling = False
        self._duelists: tuple[str, ...] = ()
        self._checking = False             # the window open is the check of the last decision
        self._cut: set[str] = set()        # shapes of this round whose window the early stop cut short
        self._recheck = False              # the round under way was started by a failed check
        self._active0 = 0
        self._open_at: float | None = None   # the window opens (settled) ...
        self._close_at: float | None = None  # ... and closes
        self._t0: float | None = None        # the first answer after it opened
        self._count = 0
        self._chosen_at: float | None = None
        self._chosen_active = 0

    @property
    def probing(self) -> bool:
        return bool(self._order)

    def answered(self, now: float, n: int, cycle_s: Cost, active: int, remaining_s: Cost) -> None:
        """Record `n` observations answered at `now` (env cycle ~cycle_s, `active` envs, the run's rest predicted
        to take remaining_s, None: not known yet); `current` may change (the caller re-plans after every answer).
        cycle_s and remaining_s may be given as functions: they are read only when a round starts or switches
        shape (the planner's estimates take medians over its samples: ~0.1-0.3 ms, at hundreds of answers per
        second on the event loop that also moves the requests)."""
        self._answered += n
        if self.probing:
            self._measure(now, n, cycle_s, active, remaining_s)
        elif self._due(now, active):
            cycle = _value(cycle_s)
            if self._affordable(cycle, _value(remaining_s)):
                self._start_round(now, cycle, active)

    def _affordable(self, cycle_s: float, remaining_s: float | None) -> bool:
        """A short run (or its last stretch) cannot pay back a round: the settle + window cycles of every shape but
        the one in use (a round measures that one first, unsettled: the run would spend that window on it anyway)."""
        return self._windows_affordable(len(self.shapes) - 1, cycle_s, remaining_s)

    def _windows_affordable(self, windows: int, cycle_s: float, remaining_s: float | None) -> bool:
        if remaining_s is None:
            return False
        return windows * (self.SETTLE_CYCLES + self.WINDOW_CYCLES) * cycle_s <= self.MAX_SHARE * remaining_s

    # -- a round
    def _due(self, now: float, active: int) -> bool:
        if active < 2 or len(self.shapes) < 2:
            return False
        if self._chosen_at is None:
            return self._answered >= self.WARM_ANSWERS * active
        return (active < self.REPROBE_ACTIVE * self._chosen_active
                or now - self._chosen_at >= self.REPROBE_S)

    def _start_round(self, now: float, cycle_s: float, active: int, recheck: bool = False) -> None:
        self._order = [self.current] + [s for s in self.shapes if s != self.current]
        self._rates, self._pooled, self._dueling, self._recheck = {}, {}, False, recheck
        self._cut = set()
        self._active0 = active
        self._begin(now, cycle_s, switched=False)   # the shape in use when the round starts has settled

    def _begin(self, now: float, cycle_s: float, switched: bool = True) -> None:
        switched = switched and self._order[0] != self.current
        self.current = self._order[0]
        self._open_at = now + (self.SETTLE_CYCLES * cycle_s if switched else 0.0)
        self._close_at = self._open_at + max(self.MIN_WINDOW_S, self.WINDOW_CYCLES * cycle_s)
        self._t0, self._count = None, 0

    def _measure(self, now: float, n: int, cycle_s: Cost, active: int, remaining_s: Cost = None) -> None:
        if now < self._open_at:
            return
        if self._t0 is None:          # the first answer after the window opened: the clock starts here
            self._t0 = now
            return
        self._count += n
        rate = self._count / max(now - self._t0, 1e-9)
        if now < self._close_at:
            # clearly the slower shape: stop paying for it (a quarter of the window is several cycles of answers;
            # not in a duel, whose shapes are close by construction, nor in a check, which costs nothing)
            quarter = self._open_at + 0.25 * (self._close_at - self._open_at)
            if self._dueling or self._checking or not (self._rates and now >= quarter
                                                       and rate < self.EARLY_STOP * max(self._rates.values())):
                return
        if self._checking:
            self._close_check(now, rate, cycle_s, active, remaining_s)
            return
        if now < self._close_at:
            self._cut.add(self.current)
        self._close_window(now, rate)
        if not self._order and not self._dueling:
            self._maybe_duel(cycle_s, remaining_s)
        if self._order:
            self._begin(now, _value(cycle_s))
        else:
            self._decide(now, active, cycle_s)

    def _close_window(self, now: float, rate: float) -> None:
        """The current shape's window ends: its rate (a round's one window per shape) and its observations and
        seconds pooled over every window of the round (what a duel compares)."""
        if not self._dueling:
            self._rates[self.current] = rate
        pool = self._pooled.setdefault(self.current, [0.0, 0.0])
        pool[0] += self._count
        pool[1] += now - self._t0
        self._order.pop(0)

    def _decide(self, now: float, active: int, cycle_s: Cost) -> None:
        """Every window of the round is done: keep the fastest (after a duel: of the two, over all their windows),
        and, unless this round was itself a recheck, open the check window of the shape kept."""
        duel = {}
        if self._dueling:
            duel = {s: c / max(t, 1e-9) for s, (c, t) in self._pooled.items() if s in self._duelists}
            best = max(duel, key=lambda s: duel[s])
        else:
            best = max(self._rates, key=lambda s: self._rates[s])
        self.rounds.append(ProbeRound(now, self._active0, dict(self._rates), best, duel, recheck=self._recheck))
        self._dueling = False
        self._chosen_at, self._chosen_active = now, active
        cycle = _value(cycle_s)
        if self._recheck or cycle is None:
            self.current = best
            return
        self._order, self._checking = [best], True
        self._begin(now, cycle)       # settles first where the last window measured another shape

    def _close_check(self, now: float, rate: float, cycle_s: Cost, active: int, remaining_s: Cost) -> None:
        """The check window of the last decision ends: where the kept shape ran more than CHECK_DROP below the rate
        it was kept for and the early stop had cut a rival's window short, measure every shape again now (if the
        rest of the run pays for it)."""
        self._order, self._checking = [], False
        last = self.rounds[-1]
        last.check = rate
        if rate >= (1.0 - self.CHECK_DROP) * last.kept_rate or (self.CHECK_NEEDS_CUT
                                                                 and not self._cut - {last.chosen}):
            return
        cycle = _value(cycle_s)
        if not self._affordable(cycle, _value(remaining_s)):
            return
        self._start_round(now, cycle, active, recheck=True)

    def _maybe_duel(self, cycle_s: Cost, remaining_s: Cost) -> None:
        """The round has measured every shape: if the two fastest are within CLOSE, alternate them for DUEL_LEGS
        more windows (starting with the one in use if it is one of them: no switch, no settling)."""
        ranked = sorted(self._rates, key=lambda s: self._rates[s], reverse=True)
        if len(ranked) < 2 or self._rates[ranked[1]] < (1.0 - self.CLOSE) * self._rates[ranked[0]]:
            return
        if not self._windows_affordable(self.DUEL_LEGS, _value(cycle_s), _value(remaining_s)):
            return
        pair = ranked[:2]
        first = self.current if self.current in pair else pair[0]
        second = pair[1] if first == pair[0] else pair[0]
        self._duelists = (first, second)
        self._order = [first if i % 2 == 0 else second for i in range(self.DUEL_LEGS)]
        self._dueling = True

    def summary(self) -> list[dict]:
        return [r.as_dict() for r in self.rounds]
