"""Writing a file so that nobody sees half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, text: str, fsync: bool = False) -> None:
    """Replace `path` with `text`: a reader, or a process killed mid-write, sees the old file or the new one, never
    part of one (a temporary file beside it, named for this process so that concurrent writers do not share it, is
    renamed over it). fsync: the bytes are on disk before the rename (a machine that crashes keeps one of the two)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
