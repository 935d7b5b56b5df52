"""Writing a file so that nobody sees half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes, fsync: bool = False) -> None:
    """Replace `path` with `data` (text is written as UTF-8): a reader, or a process killed mid-write, sees the old
    file or the new one, never part of one (a temporary file beside it, named for this process so that concurrent
    writers do not share it, is renamed over it; a write that fails, a full disk say, removes it and leaves the old
    file). fsync: the bytes are on disk before the rename (a machine that crashes keeps one of the two)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
