"""Process checks the lifecycle tests share: is a pid still running, which processes descend from one, and the
environment one was started with (read from /proc, Linux)."""

from __future__ import annotations

import time
from pathlib import Path


def start_environ(pid: int, timeout: float = 10.0) -> dict[bytes, bytes]:
    """The environment `pid` was started with. Read right after Popen returns, /proc/PID/environ can still be empty:
    the parent learns the exec succeeded (its close-on-exec pipe closes) before the kernel has laid out the new
    program's environment, a window a loaded machine widens (a CI run read None for a variable that was set)."""
    deadline = time.monotonic() + timeout
    while True:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        if raw or time.monotonic() > deadline:
            return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
        time.sleep(0.01)


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
