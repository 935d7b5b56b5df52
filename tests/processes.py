"""Process checks the lifecycle tests share: is a pid still running, and which processes descend from one (read
from /proc, Linux)."""

from __future__ import annotations

from pathlib import Path


def _state_and_parent(pid: int | str) -> tuple[str, int] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()   # after "(comm)": state, ppid
    except OSError:
        return None
    return fields[0], int(fields[1])


def running(pid: int) -> bool:
    """pid exists and is not a zombie (an exited process its parent, or its new parent, has not reaped yet)."""
    s = _state_and_parent(pid)
    return s is not None and s[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """The running processes below `pid`: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        s = _state_and_parent(stat.parent.name)
        if s is not None and s[0] not in ("Z", "X"):
            children.setdefault(s[1], []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out
