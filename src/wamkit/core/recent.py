"""Bounded lists of the most recent samples (a run's call latencies, its planner's decisions): still plain lists,
so readers slice their last N, trimmed in halves so that an append stays O(1) amortized."""

from __future__ import annotations

from typing import Any


def append_recent(items: list, item: Any, kept: int) -> None:
    """items.append(item), keeping at least the `kept` most recent items and never 2 x `kept` or more."""
    items.append(item)
    if len(items) >= 2 * kept:
        del items[:-kept]
