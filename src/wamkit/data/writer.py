"""Write LeRobot v3.0 datasets (the layout and metadata lerobot 0.6.1 writes) with pyarrow + PyAV.

    w = LeRobotWriter(root, fps=10, robot_type="panda", features={
        "observation.images.image": {"dtype": "video", "shape": [256, 256, 3], "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": [8], "names": None},
        "action": {"dtype": "float32", "shape": [7], "names": None},
    })
    for step in episode:
        w.add_frame({"observation.images.image": rgb_u8, "observation.state": s, "action": a})
    w.save_episode(task="put the bowl on the plate")
    w.finalize()

Each episode's video is encoded on its own (starting on a keyframe), then its packets are appended to the camera's
current mp4 (`from_timestamp` = frames already in that file / fps); a new file starts when the current one would pass
`video_files_size_in_mb`. Data rows go to the current data parquet until it would pass `data_files_size_in_mb`.
Files roll over to a new chunk every `chunks_size` files. Per-episode stats are stored flattened in the episodes
parquet (`stats/<feature>/<stat>`), aggregated ones in meta/stats.json (see wamkit.data.stats).

The writer checks frames and assembles episodes; its parts: `writer_video` (encode, append to mp4 files),
`writer_data` (data parquet files), `writer_meta` (meta/ at finalize), `layout` (paths).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.core.lifecycle import ClosingContext
from wamkit.data.errors import DatasetError, FeatureMissingError
from wamkit.data.layout import DATA_PATH, DEFAULT_FEATURES, EPISODES_PATH, VIDEO_PATH  # noqa: F401 - public here too
from wamkit.data.stats import image_stats, numeric_stats
from wamkit.data.writer_data import DataFileWriter
from wamkit.data.writer_meta import write_episodes, write_info, write_stats, write_tasks
from wamkit.data.writer_video import (  # noqa: F401 - VIDEO_CODECS, available_video_codecs: public here too
    VIDEO_CODECS, EpisodeVideoWriter, available_video_codecs, check_video_codec)

_DEFAULT_FEATURE_SPECS = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}


class LeRobotWriter(ClosingContext):
    """Record episodes into a new LeRobot v3.0 dataset directory (see the module docstring).

    features: {name: {"dtype": "video"|"image"?|"float32"|"int64"|"bool"|..., "shape": [...], "names": ...}} for the
    recorded features; the default columns (timestamp, frame_index, episode_index, index, task_index) are added.
    Video features must be uint8 (H, W, 3) frames. video_codec: "av1" (libsvtav1, lerobot's default), "h264" or
    "hevc"; see available_video_codecs().

    `with LeRobotWriter(...) as w:` finalizes on leaving the block, or, when it raised, closes the files and
    removes the temporary ones without writing meta/.
    """

    def __init__(self, root: str | Path, fps: int, features: dict[str, dict], robot_type: str | None = None,
                 video_codec: str = "av1", chunks_size: int = 1000, data_files_size_in_mb: float = 100,
                 video_files_size_in_mb: float = 200, overwrite: bool = False, video_options: dict | None = None):
        self.root = Path(root)
        if self.root.exists() and any(self.root.iterdir()):
            if not overwrite:
                raise DatasetError(f"dataset directory already exists and is not empty: {self.root}")
            shutil.rmtree(self.root)
        check_video_codec(video_codec)
        if int(fps) != fps or fps <= 0:
            raise DatasetError(f"fps must be a positive integer, got {fps}")
        self.fps = int(fps)
        self.robot_type = robot_type
        self.video_codec = video_codec
        self.encoder, opts = VIDEO_CODECS[video_codec]
        self.video_options = {**opts, **(video_options or {})}
        self.chunks_size = int(chunks_size)
        self.data_files_size_in_mb = data_files_size_in_mb
        self.video_files_size_in_mb = video_files_size_in_mb

        self.features: dict[str, dict] = {}
        for name, spec in features.items():
            if name in _DEFAULT_FEATURE_SPECS:
                continue
            if "dtype" not in spec or "shape" not in spec:
                raise DatasetError(f"feature {name!r} needs dtype and shape, got {spec}")
            spec = {"dtype": spec["dtype"], "shape": list(spec["shape"]), "names": spec.get("names")}
            if spec["dtype"] == "video":
                if len(spec["shape"]) != 3 or spec["shape"][2] != 3:
                    raise DatasetError(f"video feature {name!r} needs shape [H, W, 3], got {spec['shape']}")
                if spec["names"] is None:
                    spec["names"] = ["height", "width", "channels"]
            elif spec["dtype"] in ("image", "string"):
                raise DatasetError(f"feature {name!r}: dtype {spec['dtype']!r} is not supported by the writer")
            self.features[name] = spec
        for name, spec in _DEFAULT_FEATURE_SPECS.items():
            self.features[name] = dict(spec)
        self.video_keys = [k for k, f in self.features.items() if f["dtype"] == "video"]
        self.data_keys = [k for k, f in self.features.items() if f["dtype"] != "video" and k not in DEFAULT_FEATURES]

        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".wamkit_episode_", dir=self.root))
        self._videos = EpisodeVideoWriter(self.root, tmp, self.fps, video_codec, self.video_options, self.chunks_size,
                                          video_files_size_in_mb, self.video_keys)
        self._data = DataFileWriter(self.root, self.features, self.data_keys + list(DEFAULT_FEATURES),
                                    self.chunks_size, data_files_size_in_mb)
        self._buffer: list[dict] = []
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict] = []
        self._episode_stats: list[dict] = []
        self.total_frames = 0
        self._finalized = False

    # ------------------------------------------------------------------------------------------- frames
    def add_frame(self, frame: dict[str, Any]) -> None:
        if self._finalized:
            raise DatasetError("writer already finalized")
        row = {}
        for key in self.video_keys + self.data_keys:
            if key not in frame:
                raise FeatureMissingError(f"frame lacks feature {key!r}; expected: "
                                          f"{', '.join(self.video_keys + self.data_keys)}")
            v = np.asarray(frame[key].detach().cpu().numpy() if hasattr(frame[key], "detach") else frame[key])
            spec = self.features[key]
            if spec["dtype"] == "video":
                if v.dtype != np.uint8 or v.shape != tuple(spec["shape"]):
                    raise DatasetError(f"feature {key!r}: expected uint8 {tuple(spec['shape'])}, got {v.dtype} "
                                       f"{v.shape}")
            else:
                want = tuple(spec["shape"])
                if v.shape != want and not (want == (1,) and v.shape == ()):
                    raise DatasetError(f"feature {key!r}: expected shape {want}, got {v.shape}")
                v = v.astype(spec["dtype"]).reshape(want)
            row[key] = v
        unknown = [k for k in frame if k not in row and k not in ("task", "timestamp")]
        if unknown:
            raise FeatureMissingError(f"frame has feature {unknown[0]!r} that is not in the writer's features: "
                                      f"{', '.join(self.video_keys + self.data_keys)}")
        self._buffer.append(row)

    def clear_episode_buffer(self) -> None:
        self._buffer = []

    @property
    def episode_buffer_size(self) -> int:
        return len(self._buffer)

    # ------------------------------------------------------------------------------------------- episodes
    def save_episode(self, task: str) -> int:
        """Write the buffered frames as one episode of `task`; returns its episode_index."""
        if not self._buffer:
            raise DatasetError("save_episode: no frames added")
        if not isinstance(task, str) or not task:
            raise DatasetError("save_episode: task must be a non-empty string")
        n = len(self._buffer)
        ep_index = len(self.episodes)
        task_index = self.tasks.setdefault(task, len(self.tasks))
        cols: dict[str, np.ndarray] = {k: np.stack([r[k] for r in self._buffer]) for k in self.data_keys}
        frame_index = np.arange(n, dtype=np.int64)
        cols["timestamp"] = (frame_index / self.fps).astype(np.float32)
        cols["frame_index"] = frame_index
        cols["episode_index"] = np.full(n, ep_index, dtype=np.int64)
        cols["index"] = np.arange(self.total_frames, self.total_frames + n, dtype=np.int64)
        cols["task_index"] = np.full(n, task_index, dtype=np.int64)

        stats: dict[str, dict] = {}
        ep: dict[str, Any] = {"episode_index": ep_index, "tasks": [task], "length": n}
        for key in self.video_keys:
            frames = np.stack([r[key] for r in self._buffer])
            stats[key] = image_stats(frames)
            loc, from_ts, to_ts = self._videos.write_episode(key, frames, ep_index)
            if "info" not in self.features[key]:
                self.features[key]["info"] = self._videos.feature_info(*frames.shape[1:3])
            ep[f"videos/{key}/chunk_index"], ep[f"videos/{key}/file_index"] = loc
            ep[f"videos/{key}/from_timestamp"], ep[f"videos/{key}/to_timestamp"] = from_ts, to_ts
        for key in self.data_keys + list(DEFAULT_FEATURES):
            stats[key] = numeric_stats(cols[key])
        data_loc = self._data.write_episode(cols)
        ep_row = {"episode_index": ep_index, "tasks": [task], "length": n, "data/chunk_index": data_loc[0],
                  "data/file_index": data_loc[1], "dataset_from_index": self.total_frames,
                  "dataset_to_index": self.total_frames + n}
        for key in self.video_keys:
            for s in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
                ep_row[f"videos/{key}/{s}"] = ep[f"videos/{key}/{s}"]
        self.episodes.append(ep_row)
        self._episode_stats.append(stats)
        self.total_frames += n
        self._buffer = []
        return ep_index

    # ------------------------------------------------------------------------------------------- finalize
    def finalize(self) -> Path:
        """Close video files and write meta/ (info.json, stats.json, tasks.parquet, episodes parquet)."""
        if self._finalized:
            return self.root
        if self._buffer:
            raise DatasetError(f"finalize: {len(self._buffer)} frames added but not saved (call save_episode)")
        if not self.episodes:   # its meta/ would read as a dataset, and no reader takes one without episodes
            self.abort()
            raise DatasetError(f"finalize: no episode saved; nothing written to {self.root}")
        self._videos.close()
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        write_tasks(meta, self.tasks)
        write_episodes(self.root, self.episodes, self._episode_stats, self.features)
        write_stats(meta, self._episode_stats)
        write_info(meta, fps=self.fps, features=self.features, episodes=len(self.episodes), frames=self.total_frames,
                   tasks=len(self.tasks), chunks_size=self.chunks_size,
                   data_files_size_in_mb=self.data_files_size_in_mb,
                   video_files_size_in_mb=self.video_files_size_in_mb, robot_type=self.robot_type,
                   has_video=bool(self.video_keys))
        self._finalized = True
        return self.root

    def abort(self) -> None:
        """Close the video files and remove the temporary ones; meta/ is not written (the dataset is incomplete)."""
        self._videos.close()

    def _release(self, failed: bool) -> None:
        if failed:
            self.abort()
        else:
            self.finalize()
