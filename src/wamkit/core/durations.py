"""How a duration reads in progress lines and logs (train, eval, record): one format everywhere."""

from __future__ import annotations


def fmt_duration(s: float) -> str:
    """Seconds as 45s, 3m05s, 1h02m."""
    s = max(0, int(round(s)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
