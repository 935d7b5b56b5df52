"""Reading a LeRobot v3.0 dataset's metadata and tables: meta/info.json (checked field by field), meta/stats.json
(checked feature by feature), tasks.parquet, the episodes parquet files; every missing or unreadable file is one error
naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.data.errors import CorruptFileError, DatasetError, MissingFileError
from wamkit.core.config import is_number as _is_number
from wamkit.data.layout import template_problem

# the feature dtypes of LeRobot v3 (HF `datasets` Value dtypes + video/image); a typo here used to read silently
NUMERIC_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                            "float16", "float32", "float64"})
KNOWN_DTYPES = NUMERIC_DTYPES | {"video", "image", "string", "large_string"}


def check_info(info: Any, path: Path) -> None:
    """meta/info.json's fields that the reader relies on: one DatasetError naming the file and the field."""
    def bad(field: str, problem: str) -> DatasetError:
        return DatasetError(f"{path}: field {field!r}: {problem}")

    if not isinstance(info, dict):
        raise DatasetError(f"{path}: expected a JSON object, got {type(info).__name__}")
    version = str(info.get("codebase_version", ""))
    if not version.startswith("v3"):
        raise bad("codebase_version", f"{version!r} is not a LeRobot v3 dataset")
    fps = info.get("fps")
    if fps is None:
        raise bad("fps", "missing")
    if not _is_number(fps) or fps <= 0:
        raise bad("fps", f"expected a number > 0, got {fps!r}")
    feats = info.get("features")
    if feats is None:
        raise bad("features", "missing")
    if not isinstance(feats, dict) or not feats:
        raise bad("features", f"expected a non-empty mapping of feature name -> spec, got {feats!r}"[:300])
    for name, f in feats.items():
        if not isinstance(f, dict) or not isinstance(f.get("dtype"), str):
            raise bad(f"features.{name}", f"expected a mapping with a 'dtype' string, got {f!r}"[:300])
        if f["dtype"] not in KNOWN_DTYPES:
            raise bad(f"features.{name}.dtype",
                      f"unknown dtype {f['dtype']!r}; known: {', '.join(sorted(KNOWN_DTYPES))}"[:300])
        shape = f.get("shape")
        if not isinstance(shape, list) or not shape or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
            raise bad(f"features.{name}.shape", f"expected a list of positive integers, got {shape!r}")
        if f["dtype"] in ("video", "image") and (len(shape) != 3 or shape[2] not in (1, 3, 4)):
            raise bad(f"features.{name}.shape", f"expected [height, width, channels] for a {f['dtype']}, got {shape}")
    need = ["data_path"] + (["video_path"] if any(f["dtype"] == "video" for f in feats.values()) else [])
    for key in need:
        if key not in info:
            raise bad(key, "missing")
        problem = template_problem(info[key])
        if problem:
            raise bad(key, problem)
    total = info.get("total_frames")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise bad("total_frames", f"expected an integer >= 0, got {total!r}")


def check_stats(stats: Any, path: Path) -> None:
    """meta/stats.json is a mapping of feature -> {stat: number or (nested, rectangular) list of numbers}; anything
    else is one DatasetError naming the file and the feature (was an AttributeError/ValueError traceback)."""
    if not isinstance(stats, dict):
        raise DatasetError(f"{path}: expected a JSON object of feature -> stats, got {type(stats).__name__}")
    for feat, st in stats.items():
        if not isinstance(st, dict):
            raise DatasetError(f"{path}: feature {feat!r}: expected a mapping of stat -> numbers, got "
                               f"{type(st).__name__}")
        for key, v in st.items():
            try:
                np.asarray(v, dtype=float)
            except (TypeError, ValueError):
                raise DatasetError(f"{path}: feature {feat!r}: stat {key!r} is not a number or a rectangular list "
                                   f"of numbers: {str(v)[:80]}") from None


def read_stats(path: Path) -> dict:
    """meta/stats.json, checked (check_stats); {} when the file is absent (lerobot's readers do not need it)."""
    if not path.exists():
        return {}
    stats = read_json(path)
    check_stats(stats, path)
    return stats


def read_json(path: Path) -> Any:
    if not path.exists():
        raise MissingFileError(path, "metadata file")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(path, f"invalid JSON: {e}") from None


def read_parquet(path: Path, what: str = "parquet file"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.exists():
        raise MissingFileError(path, what)
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise CorruptFileError(path, str(e).splitlines()[0][:200]) from None



def read_tasks(path: Path) -> dict[int, str]:
    """tasks.parquet -> {task_index: task}; the task string is a `task` column (lerobot 0.6) or the pandas index
    (`__index_level_0__`, older writers)."""
    t = read_parquet(path, "tasks file")
    names = t.column_names
    key = None
    for cand in ("task", "__index_level_0__"):
        if cand in names:
            key = cand
            break
    if key is None and t.schema.metadata and b"pandas" in t.schema.metadata:
        idx = json.loads(t.schema.metadata[b"pandas"]).get("index_columns", [])
        key = next((c for c in idx if isinstance(c, str) and c in names), None)
    if key is None or "task_index" not in names:
        raise DatasetError(f"{path}: expected a task_index column and a task column/index, got columns {names}")
    tasks: dict[int, str] = {}
    for row, (i, s) in enumerate(zip(t.column("task_index").to_pylist(), t.column(key).to_pylist())):
        if not isinstance(i, int) or isinstance(i, bool):
            raise DatasetError(f"{path}: row {row}: task_index must be an integer, got {i!r}")
        if i in tasks:   # a dict would keep the last one: rows of that index would train on the wrong task
            raise DatasetError(f"{path}: row {row}: task_index {i} appears twice ({tasks[i]!r} and {s!r})"[:300])
        tasks[i] = str(s)
    return tasks



def episodes_files(root: Path) -> list[Path]:
    return sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))


def read_episodes(root: Path, total_episodes: Any = None) -> list[dict]:
    """Rows of the episodes parquet files without their stats columns, sorted by episode_index; the columns that
    locate an episode's data are checked. `total_episodes` (info.json's) tells an empty dataset from a broken one."""
    ep_dir = root / "meta" / "episodes"
    files = episodes_files(root)
    if not files and total_episodes == 0:
        raise DatasetError(f"{root}: dataset has no episodes (meta/info.json: total_episodes 0)")
    if not files:
        raise MissingFileError(ep_dir / "chunk-000" / "file-000.parquet", "episodes metadata file")
    rows: list[dict] = []
    for f in files:
        t = read_parquet(f, "episodes metadata file")
        missing = [c for c in ("episode_index", "data/chunk_index", "data/file_index") if c not in t.column_names]
        if missing:
            raise DatasetError(f"{f}: column {missing[0]!r} missing")
        keep = [c for c in t.column_names if not c.startswith("stats/")]
        for r in t.select(keep).to_pylist():
            for c in ("episode_index", "data/chunk_index", "data/file_index"):
                if not isinstance(r[c], int) or r[c] < 0:
                    raise DatasetError(f"{f}: column {c!r}: expected integers >= 0, got {r[c]!r}")
            rows.append(r)
    rows.sort(key=lambda r: int(r["episode_index"]))
    return rows


def read_episode_stats(root: Path) -> list[dict]:
    """Per-episode `stats/<feature>/<stat>` columns of the episodes parquet, one dict per episode."""
    out = []
    for f in episodes_files(root):
        t = read_parquet(f, "episodes metadata file")
        keep = ["episode_index"] + [c for c in t.column_names if c.startswith("stats/")]
        out.extend(t.select(keep).to_pylist())
    return sorted(out, key=lambda r: r["episode_index"])
