"""Names for the shared-memory files a process creates under /dev/shm, the sweep that removes those of processes
that died without removing them, and the one test of "the process that owns this is gone" (the sweep's, and that of
the private Ray's temp dirs: `wamkit.runtime.ray_session.remove_stale_temp_dirs`).

A process killed with SIGKILL (or by the OOM killer) runs no atexit handler and no `finally`, so every shared-memory
file it created stays in /dev/shm, holding its memory, until the machine restarts. Files named here carry their
creator's pid; a process that creates such files sweeps first: files of this user, with the same prefix, whose pid
no longer runs, are unlinked. (A pid reused by another process keeps its dead namesake's file until that process
ends too: nothing live is ever removed. An owner recorded with its start time, `process_start`, is known gone as
soon as its pid is reused.)"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from wamkit.core.pids import pid_alive

SHM_DIR = "/dev/shm"


def owned_name(prefix: str) -> str:
    """A fresh name: `prefix` + this process's pid + '_' + 24 random hex digits."""
    return f"{prefix}{os.getpid()}_{secrets.token_hex(12)}"


def process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, from /proc): tells a live pid from a reused one. None when
    unknown (no such process, no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_gone(pid: int, start: str | None = None) -> bool:
    """True only when sure that the process which owns a file is gone: `pid` no longer runs, or (given `start`, its
    process_start when it made the file) that pid now belongs to another process. Never true for this process."""
    if pid == os.getpid():
        return False
    if not pid_alive(pid):
        return True
    now = process_start(pid) if start is not None else None
    return now is not None and now != start


def sweep_orphans(prefix: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this user's files in `shm_dir` named by owned_name(prefix) for a pid that no longer runs; returns the
    names removed."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)_[0-9a-f]{{24}}$")
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        if m is None or not owner_gone(int(m.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
    return removed
