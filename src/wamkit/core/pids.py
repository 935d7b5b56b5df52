"""Whether a process id runs (for files named or held by a pid: shared memory, an output directory's lock)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if a process with this id runs (or exists as another user's, which we may not signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
