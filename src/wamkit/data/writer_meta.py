"""The meta/ directory of a LeRobot v3.0 dataset, written once when the writer finalizes: tasks.parquet, the episodes
parquet (one file, with flattened per-episode stats `stats/<feature>/<stat>`), stats.json (aggregated, see
wamkit.data.stats) and info.json, in the layout lerobot 0.6.1 writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.data.layout import DATA_PATH, EPISODES_PATH, VIDEO_PATH, format_path
from wamkit.data.stats import STAT_KEYS, aggregate_stats, stats_to_json


def write_tasks(meta: Path, tasks: dict[str, int]) -> None:
    """tasks.parquet: the task string as the (pandas) index, written as column `task`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ordered = sorted(tasks.items(), key=lambda kv: kv[1])
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                            "metadata": {"encoding": "UTF-8"}}],
        "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                     "numpy_type": "int64", "metadata": None},
                    {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object",
                     "metadata": None}],
        "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__},
    }
    t = pa.table({"task_index": pa.array([i for _, i in ordered], pa.int64()),
                  "task": pa.array([s for s, _ in ordered], pa.string())})
    pq.write_table(t.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()}), meta / "tasks.parquet")


def write_episodes(root: Path, episodes: list[dict], episode_stats: list[dict], features: dict[str, dict]) -> None:
    """meta/episodes/chunk-000/file-000.parquet: one row per episode with its flattened stats (none: no file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for ep, st in zip(episodes, episode_stats):
        row = dict(ep)
        for feat in features:
            if feat not in st:
                continue
            for sk in STAT_KEYS:
                row[f"stats/{feat}/{sk}"] = np.asarray(st[feat][sk]).tolist()
        row["meta/episodes/chunk_index"] = 0
        row["meta/episodes/file_index"] = 0
        rows.append(row)
    if rows:
        ep_path = root / format_path(EPISODES_PATH, 0, 0)
        ep_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), ep_path)


def write_stats(meta: Path, episode_stats: list[dict]) -> None:
    agg = aggregate_stats(episode_stats) if episode_stats else {}
    (meta / "stats.json").write_text(json.dumps(stats_to_json(agg), indent=4))


def write_info(meta: Path, *, fps: int, features: dict[str, dict], episodes: int, frames: int, tasks: int,
               chunks_size: int, data_files_size_in_mb: float, video_files_size_in_mb: float,
               robot_type: str | None, has_video: bool) -> None:
    info: dict[str, Any] = {
        "codebase_version": "v3.0",
        "fps": fps,
        "features": features,
        "total_episodes": episodes,
        "total_frames": frames,
        "total_tasks": tasks,
        "chunks_size": chunks_size,
        "data_files_size_in_mb": data_files_size_in_mb,
        "video_files_size_in_mb": video_files_size_in_mb,
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if has_video else None,
        "robot_type": robot_type,
        "splits": {"train": f"0:{episodes}"},
    }
    (meta / "info.json").write_text(json.dumps(info, indent=4))
