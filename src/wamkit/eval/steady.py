"""Where auto's rate goes against the best fixed row of a bench: its start (the probe: every shape measured for a
few windows), its steady state (the shape it kept) and the tail (the last episodes, envs falling idle one by one).

A row's whole-run rate mixes the three. On the 32-env GPU rows of sessions 21-22 auto ran at 0.95 of the best fixed
row while its probe kept the shape of that row; the question the whole-run ratio cannot answer is whether the loss
is the probe's cost (bounded: a few seconds of slower shapes, paid once) or a slower steady state (a cost the
planner's path adds to every chunk). This module answers it from each row's `progress` (Timeline.progress: chunks
per time bin from the run's first span, and when its last episode began), round by round:

- the *steady span* runs from the first bin after auto's first decision (its probe round, and the recheck a failed
  check starts, if any) to the earlier of the two rows' tails (`tail_from_s`);
- `steady_ratio`: auto's chunks over that span / the fixed row's over the same span;
- `probe_cost_s`: the chunks auto ran fewer than the fixed row before the span, in seconds of the fixed row's
  steady pace;
- `tail_s`: each row's run from its tail's start to its end.

Both rows must have the same bin width (runs of similar length do); a round without both progress records or with
different bins is left out."""

from __future__ import annotations

import math
import statistics
from typing import Any


def settled_s(auto_shape: dict[str, Any] | None) -> float | None:
    """When auto's first decision was made (seconds from the run's start): its first probe round's end, or the end
    of the recheck that round's failed check started. None: auto did not probe (one shape, or too short a run)."""
    rounds = (auto_shape or {}).get("rounds") or []
    if not rounds:
        return None
    end = rounds[0]["at_s"]
    if len(rounds) > 1 and rounds[1].get("recheck"):
        end = rounds[1]["at_s"]
    return float(end)


def steady_round(auto: dict[str, Any], fixed: dict[str, Any], settled: float | None) -> dict[str, Any] | None:
    """One round: auto's progress against the fixed row's over the steady span (module docstring). settled: auto's
    first decision (settled_s; None: from the first bin). None where the two cannot be compared."""
    if not auto or not fixed or auto.get("bin_s") != fixed.get("bin_s"):
        return None
    b = auto["bin_s"]
    lo = 0 if settled is None else int(math.floor(settled / b)) + 1   # the first whole bin after the decision
    hi = int(math.floor(min(auto["tail_from_s"], fixed["tail_from_s"]) / b))   # bins wholly before either tail
    if hi <= lo:
        return None
    a_span, f_span = sum(auto["chunks"][lo:hi]), sum(fixed["chunks"][lo:hi])
    if f_span <= 0:
        return None
    f_pace = f_span / ((hi - lo) * b)   # the fixed row's chunks per second over the span
    deficit = sum(fixed["chunks"][:lo]) - sum(auto["chunks"][:lo])
    return {"from_s": lo * b, "to_s": hi * b, "steady_ratio": a_span / f_span,
            "probe_cost_s": deficit / f_pace,
            "tail_s": [round(p["wall_s"] - p["tail_from_s"], 3) for p in (auto, fixed)]}


def _per_round(row: dict[str, Any], key: str, single: str) -> list:
    """A row's per-round records (bench's _median_row keeps them as `<key>`), or its one run's as a list of one."""
    return row.get(key) or ([row.get(single)] if row.get(single) is not None else [])


def steady_vs_best_fixed(rows: list[dict[str, Any]], best_fixed: dict[str, str]) -> dict[str, dict[str, Any]]:
    """For each auto row named in best_fixed (auto row -> its best fixed row, bench.auto_vs_best_fixed), the rounds
    compared by steady_round and the median steady ratio and probe cost over them. {} where no round compares."""
    by_name = {x["row"]: x for x in rows}
    out = {}
    for name, fixed_name in best_fixed.items():
        a, f = by_name.get(name), by_name.get(fixed_name)
        if a is None or f is None:
            continue
        progress_a = _per_round(a, "progress_rounds", "progress")
        progress_f = _per_round(f, "progress_rounds", "progress")
        shapes = _per_round(a, "auto_shape_rounds", "auto_shape")
        rounds = []
        for k, (pa, pf) in enumerate(zip(progress_a, progress_f)):
            r = steady_round(pa, pf, settled_s(shapes[k] if k < len(shapes) else None))
            if r is not None:
                rounds.append(dict(r, round=k + 1))
        if rounds:
            out[name] = {"best_fixed": fixed_name, "rounds": rounds,
                         "steady_ratio": statistics.median(r["steady_ratio"] for r in rounds),
                         "probe_cost_s": statistics.median(r["probe_cost_s"] for r in rounds)}
    return out


def steady_lines(steady: dict[str, dict[str, Any]]) -> list[str]:
    """One line per auto row: its steady ratio and probe cost, round by round."""
    out = []
    for name, d in steady.items():
        per = "; ".join(f"round {r['round']}: {r['steady_ratio']:.3f} from {r['from_s']:.1f} to {r['to_s']:.1f} s, "
                        f"probe cost {r['probe_cost_s']:.2f} s, tails {r['tail_s'][0]:.1f} / {r['tail_s'][1]:.1f} s"
                        for r in d["rounds"])
        out.append(f"{name} between its first decision and the tail: {d['steady_ratio']:.3f} of {d['best_fixed']}'s "
                   f"pace over the same span (median), its probe cost {d['probe_cost_s']:.2f} s of that row's pace "
                   f"({per}).")
    return out
