"""Where things are in a LeRobot v3.0 dataset directory: the path templates, the checks that keep every resolved path
inside the dataset, and `DatasetFiles`, the index from an episode to its data and video files.

    meta/info.json, meta/stats.json, meta/tasks.parquet, meta/episodes/chunk-XXX/file-YYY.parquet,
    data/chunk-XXX/file-YYY.parquet, videos/<key>/chunk-XXX/file-YYY.mp4

Files are numbered (chunk_index, file_index); a chunk holds `chunks_size` files (`next_file`).
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

from wamkit.core.config import is_number
from wamkit.data.errors import DatasetError, MissingFileError

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"

DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")
CAMERA_PREFIX = "observation.images."

TEMPLATE_FIELDS = ("chunk_index", "file_index", "episode_chunk", "episode_file", "video_key")


def format_path(template: str, chunk_index: int, file_index: int, video_key: str | None = None) -> str:
    """Fill a v3 path template; accepts both `{chunk_index}/{file_index}` and `{episode_chunk}/{episode_file}`."""
    return template.format(chunk_index=int(chunk_index), file_index=int(file_index), episode_chunk=int(chunk_index),
                           episode_file=int(file_index), video_key=video_key)


def next_file(loc: tuple[int, int], chunks_size: int) -> tuple[int, int]:
    """The (chunk_index, file_index) after `loc`: the next file, or the first of the next chunk."""
    c, f = loc
    f += 1
    if f >= chunks_size:
        c, f = c + 1, 0
    return c, f


def template_problem(template: Any) -> str | None:
    """Why a path template from info.json is unsafe or malformed, or None: only the v3 fields, no attribute or index
    access (`{video_key.__class__}`), a relative path."""
    if not isinstance(template, str) or not template:
        return f"expected a path template string, got {template!r}"
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return f"malformed template {template!r} ({e})"
    bad = [f for f in fields if f not in TEMPLATE_FIELDS]
    if bad:
        return f"template field {{{bad[0]}}} is not one of {', '.join(TEMPLATE_FIELDS)}"
    if os.path.isabs(template) or template.startswith(("/", "\\")):
        return f"template {template!r} is an absolute path; it must stay inside the dataset directory"
    try:   # a bad format spec ({chunk_index:03q}) only fails when filled
        format_path(template, 0, 0, "key")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return f"malformed template {template!r} ({e})"
    return None


def inside(root: Path, rel: str, what: str) -> Path:
    """root / rel, refused (DatasetError) when rel is absolute or climbs out of root (`../`). Lexical: a symlink the
    user placed inside the dataset is followed as usual."""
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep) or os.path.isabs(norm):
        raise DatasetError(f"{root}: {what} {rel!r} points outside the dataset directory; refused")
    return root / norm


class DatasetFiles:
    """Episode -> its data file and its video files (info.json's templates filled from the episodes metadata),
    every path checked to stay inside the dataset."""

    def __init__(self, root: Path, info: dict, episodes: list[dict]):
        self.root, self.info, self.episodes = root, info, episodes

    def data_files(self) -> list[Path]:
        """The data parquet files, in the order the episodes first use them."""
        seen: list[tuple[int, int]] = []
        for e in self.episodes:
            key = (int(e["data/chunk_index"]), int(e["data/file_index"]))
            if key not in seen:
                seen.append(key)
        return [inside(self.root, format_path(self.info["data_path"], c, f), "data file") for c, f in seen]

    def video_path(self, key: str, episode: dict) -> Path:
        c = episode.get(f"videos/{key}/chunk_index")
        f = episode.get(f"videos/{key}/file_index")
        if c is None or f is None:
            raise DatasetError(f"{self.root}: episode {episode['episode_index']} has no video location for {key!r}")
        if not isinstance(c, int) or not isinstance(f, int) or c < 0 or f < 0:
            raise DatasetError(f"{self.root}: episode {episode['episode_index']}: videos/{key}/chunk_index and "
                               f"file_index must be integers >= 0, got {c!r}, {f!r}")
        return inside(self.root, format_path(self.info["video_path"], c, f, video_key=key), "video file")

    def video_files(self, key: str) -> list[Path]:
        """The distinct video files of camera feature `key`, in episode order."""
        out: list[Path] = []
        for e in self.episodes:
            p = self.video_path(key, e)
            if p not in out:
                out.append(p)
        return out

    def check_videos(self, video_keys: list[str]) -> None:
        """Every episode has a start time in its video, and every video file exists (not decoded: see
        LeRobotDataset.verify_videos)."""
        for key in video_keys:
            seen = set()
            for e in self.episodes:
                t0 = e.get(f"videos/{key}/from_timestamp")
                if not is_number(t0) or t0 < 0:
                    raise DatasetError(f"{self.root}/meta/episodes: episode {e['episode_index']}: column "
                                       f"'videos/{key}/from_timestamp' must be a number >= 0, got {t0!r}")
                p = self.video_path(key, e)
                if p not in seen:
                    seen.add(p)
                    if not p.exists():
                        raise MissingFileError(p, f"video file for {key}")
