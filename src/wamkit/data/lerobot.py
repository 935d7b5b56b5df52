"""Read LeRobot v3.0 datasets with pyarrow + PyAV (no lerobot import).

    ds = LeRobotDataset("path/to/dataset", cameras=["image", "wrist_image"], check_fps=10)
    item = ds[0]   # {"observation.images.image": uint8 (H,W,3), "action": f32 (7,), "observation.state": ..., "task": str,
                   #  "episode_index", "frame_index", "timestamp", "index", "task_index"}
    actions, mask = ds.get_action_chunk(0, horizon=16)

Layout (LeRobot v3.0, see docs/data.md): meta/info.json, meta/stats.json, meta/tasks.parquet,
meta/episodes/chunk-XXX/file-YYY.parquet, data/chunk-XXX/file-YYY.parquet, videos/<key>/chunk-XXX/file-YYY.mp4.
Episodes share mp4 files; the frame of a row is at ``videos/<key>/from_timestamp + timestamp`` in its episode's file.

Frame lookup follows lerobot's rule (nearest decoded frame within ``tolerance_s``; see wamkit.data.frames).

The dataset assembles samples; its parts: `metadata` (info.json, tasks, episodes), `layout` (paths, the episode ->
file index), `columns` (the data parquet rows), `frames` (video decoding, image cells).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np

from wamkit.core.config import is_number
from wamkit.core.lifecycle import ClosingContext
from wamkit.data.columns import DataColumns, column_to_numpy  # noqa: F401 - public here too
from wamkit.data.errors import DatasetError, FeatureMissingError, FpsMismatchError, MissingFileError
from wamkit.data.frames import VideoDecoder, VideoFrames, decode_image_cell, probe_stream, probe_video  # noqa: F401
from wamkit.data.layout import (  # noqa: F401 - the v3 layout's names, public here too
    CAMERA_PREFIX, DEFAULT_FEATURES, TEMPLATE_FIELDS, DatasetFiles, format_path, inside, template_problem)
from wamkit.data.metadata import (  # noqa: F401
    check_info, read_episode_stats, read_episodes, read_json, read_parquet, read_stats, read_tasks)


class LeRobotDataset(ClosingContext):
    """A LeRobot v3.0 dataset on local disk, read with pyarrow + PyAV.

    root: dataset directory (with meta/, data/, videos/).
    cameras: video/image features to decode (`observation.images.<cam>` or just `<cam>`); None = all.
    check_fps: expected fps (from a config); a different dataset fps raises FpsMismatchError unless
        allow_fps_mismatch=True.
    required_features: feature names that must exist (FeatureMissingError names the missing one).
    tolerance_s: max distance between a query timestamp and the decoded frame (lerobot's default 1e-4 s).
    `close()` (or leaving a `with` block) closes the open video files.
    """

    def __init__(self, root: str | Path, cameras: Iterable[str] | None = None, check_fps: float | None = None,
                 allow_fps_mismatch: bool = False, required_features: Iterable[str] = (), tolerance_s: float = 1e-4,
                 video_cache_size: int = 16):
        self.root = Path(root)
        if not self.root.is_dir():
            raise MissingFileError(self.root, "dataset directory")
        self.info: dict = read_json(self.root / "meta" / "info.json")
        check_info(self.info, self.root / "meta" / "info.json")
        self.fps = float(self.info["fps"])
        if float(self.fps).is_integer():
            self.fps = int(self.fps)
        self.features: dict[str, dict] = self.info["features"]
        self.tolerance_s = float(tolerance_s)

        if check_fps is not None and abs(float(check_fps) - float(self.fps)) > 1e-6 and not allow_fps_mismatch:
            raise FpsMismatchError(
                f"{self.root}: dataset fps is {self.fps} but the config expects {check_fps}; a different fps trains "
                f"the wrong time scale (set the config's fps to {self.fps}, or allow_fps_mismatch=true)")
        missing = [f for f in required_features if f not in self.features]
        if missing:
            raise FeatureMissingError(f"{self.root}: feature {missing[0]!r} not in dataset; available: "
                                      f"{', '.join(self.features)}")

        visual = [k for k, f in self.features.items() if f.get("dtype") in ("video", "image")]
        if cameras is None:
            self.camera_keys = visual
        else:
            self.camera_keys = []
            for c in cameras:
                key = c if c in self.features else CAMERA_PREFIX + c
                if key not in visual:
                    short = [k[len(CAMERA_PREFIX):] if k.startswith(CAMERA_PREFIX) else k for k in visual]
                    raise FeatureMissingError(f"{self.root}: camera {c!r} not in dataset; available cameras: "
                                              f"{', '.join(short) or '(none)'}")
                self.camera_keys.append(key)
        self.video_keys = [k for k in self.camera_keys if self.features[k]["dtype"] == "video"]

        self.tasks: dict[int, str] = read_tasks(self.root / "meta" / "tasks.parquet")
        self.episodes: list[dict] = read_episodes(self.root, self.info.get("total_episodes"))
        self._episode_by_index = {int(e["episode_index"]): e for e in self.episodes}
        self.files = DatasetFiles(self.root, self.info, self.episodes)
        self.rows = DataColumns(self.root, self.info, self.files.data_files())
        self.rows.check_episodes(self._episode_by_index)
        self.rows.check_tasks(self.tasks)
        self.rows.check_timestamps(float(self.fps), self.tolerance_s)
        self._columns = self.rows.columns
        self.files.check_videos(self.video_keys)
        self.rows.check_video_ends(self._episode_by_index, self.video_keys, float(self.fps), self.tolerance_s)
        self._frames = VideoFrames(self.tolerance_s, video_cache_size)

    # ------------------------------------------------------------------------------------------- metadata
    @property
    def stats(self) -> dict:
        """meta/stats.json, checked ({} when absent; a malformed one is a DatasetError naming the file and the
        feature)."""
        return read_stats(self.root / "meta" / "stats.json")

    def episode_stats(self) -> list[dict]:
        """Per-episode `stats/<feature>/<stat>` columns of the episodes parquet, one dict per episode."""
        return read_episode_stats(self.root)

    def verify_videos(self) -> int:
        """Check every video file of the selected cameras against what the episodes read from it: its first frame
        decodes at the feature's shape, its stream's frame rate is the dataset's fps (and the feature's video.fps),
        and the last frame the episodes need from it (the largest from_timestamp + last row timestamp) decodes
        within tolerance_s (a seek to it). A garbage, empty, truncated or short mp4, or one at another frame rate,
        raises (CorruptFileError / FrameTimestampError / DatasetError, one line naming the file). The frames in
        between are not decoded. Returns the number of files checked."""
        checked = 0
        for key in self.video_keys:
            for p, t_last in self._last_frame_times(key).items():
                self._check_stream(key, p)
                dec = VideoDecoder(p, tolerance_s=self.tolerance_s)
                try:
                    dec.get(t_last)
                finally:
                    dec.close()
                checked += 1
        return checked

    def _last_frame_times(self, key: str) -> dict[Path, float]:
        """Video file of camera `key` -> the time of the last frame an episode reads from it."""
        ts = self.rows.columns["timestamp"].reshape(len(self.rows), -1)[:, 0]
        out: dict[Path, float] = {}
        for e in self.episodes:
            last = self.rows.episode_runs[int(e["episode_index"])][1] - 1
            p = self.files.video_path(key, e)
            t = float(e[f"videos/{key}/from_timestamp"]) + float(ts[last])
            out[p] = max(out.get(p, t), t)
        return out

    def _check_stream(self, key: str, p: Path) -> None:
        h, w, rate = probe_stream(p)
        want = self.features[key]["shape"][:2]
        if [h, w] != list(want):
            raise DatasetError(f"{p}: frames are {h}x{w} but features.{key}.shape declares {want[0]}x{want[1]}")
        info = self.features[key].get("info")
        video_fps = info.get("video.fps") if isinstance(info, dict) else None
        for what, fps in (("meta/info.json fps", self.fps), (f"features.{key}.info video.fps", video_fps)):
            # a video at another rate decodes every row at another time (at 2x, row 5 got row 10's frame)
            if rate is not None and is_number(fps) and abs(rate - float(fps)) > 1e-3 * float(fps):
                raise DatasetError(f"{p}: the video stream runs at {rate:g} fps but {what} is {fps:g}")

    # ------------------------------------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_frames(self) -> int:
        return len(self.rows)

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def cameras(self) -> list[str]:
        """Short camera names (`observation.images.<cam>` -> `<cam>`) of the selected camera features."""
        return [k[len(CAMERA_PREFIX):] if k.startswith(CAMERA_PREFIX) else k for k in self.camera_keys]

    def column(self, name: str) -> np.ndarray:
        """A whole non-video column as numpy (e.g. `ds.column("action")` -> (N, 7))."""
        return self.rows.column(name)

    def check_finite(self, names: Iterable[str]) -> None:
        """DatasetError naming the data file, row and episode of the first NaN/inf in the columns `names` (training
        checks `action` and, when the policy reads it, `observation.state`)."""
        self.rows.check_finite(list(names))

    def video_stats(self) -> dict[str, int]:
        """Decoder counters summed over files: opens, seeks, decoded frames."""
        return self._frames.stats()

    def close(self) -> None:
        self._frames.close()

    def get_frame(self, i: int, key: str) -> np.ndarray:
        """uint8 (H, W, 3) image of camera feature `key` at row i."""
        ep = self._episode_by_index[int(self._columns["episode_index"][i])]
        feat = self.features[key]
        if feat["dtype"] == "image":
            return decode_image_cell(self._columns[key][i], self.root)
        t = float(ep[f"videos/{key}/from_timestamp"]) + float(self._columns["timestamp"][i])
        return self._frames.get(self.files.video_path(key, ep), t).copy()

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = len(self.rows)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for dataset of {n} frames")
        item: dict[str, Any] = {}
        for name, col in self._columns.items():
            if name in self.features and self.features[name].get("dtype") == "image":
                continue
            item[name] = col[i]
        for key in self.camera_keys:
            item[key] = self.get_frame(i, key)
        ti = item.get("task_index")
        item["task"] = self.tasks.get(int(ti), "") if ti is not None else ""
        return item

    def get_action_chunk(self, i: int, horizon: int, key: str = "action") -> tuple[np.ndarray, np.ndarray]:
        """Actions of rows i .. i+horizon-1 of i's episode: (horizon, D) and a bool mask (False = padding, which
        repeats the episode's last action)."""
        return self.rows.action_chunk(i, horizon, key)

    def episode_rows(self, episode_index: int) -> tuple[int, int]:
        """[start, end) rows of an episode."""
        return self.rows.episode_rows(episode_index)

    def __repr__(self) -> str:
        return (f"LeRobotDataset({str(self.root)!r}, episodes={self.num_episodes}, frames={len(self)}, fps={self.fps}, "
                f"cameras={self.cameras})")
