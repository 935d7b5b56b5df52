"""Progress text of long runs (eval, record): rates so far and the time left at that rate."""

from __future__ import annotations


def fmt_duration(s: float) -> str:
    """Seconds as 45s, 3m05s, 1h02m."""
    s = max(0, int(round(s)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def rate_text(done: int, env_steps: int | None, elapsed_s: float, remaining: int) -> str:
    """`12.3 steps/s 410 ep/h ETA 3m05s`: rates of this run (`done` episodes, `env_steps` steps in `elapsed_s`) and
    the time left for the `remaining` episodes at that rate; "" before the first episode."""
    if done <= 0 or elapsed_s <= 0:
        return ""
    eta = f"ETA {fmt_duration(remaining * elapsed_s / done)}" if remaining > 0 else "done"
    steps = f"{env_steps / elapsed_s:.1f} steps/s " if env_steps is not None else ""
    return f"{steps}{done / elapsed_s * 3600:.0f} ep/h {eta}"
