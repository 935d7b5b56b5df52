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
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.data.errors import DatasetError, FeatureMissingError
from wamkit.data.lerobot import DEFAULT_FEATURES, format_path
from wamkit.data.stats import STAT_KEYS, aggregate_stats, image_stats, numeric_stats, stats_to_json

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"

_DEFAULT_FEATURE_SPECS = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}

# codec name in info.json -> (PyAV encoder, encoder options)
VIDEO_CODECS = {
    "av1": ("libsvtav1", {"g": 2, "crf": 30, "preset": 12}),
    "h264": ("libx264", {"g": 2, "crf": 23, "preset": "veryfast"}),
    "hevc": ("libx265", {"g": 2, "crf": 28, "preset": "veryfast"}),
}


def available_video_codecs() -> list[str]:
    import av

    out = []
    for name, (enc, _) in VIDEO_CODECS.items():
        try:
            av.codec.Codec(enc, "w")
            out.append(name)
        except Exception:  # noqa: BLE001 - unknown encoder in this FFmpeg build
            pass
    return out


class _VideoFile:
    """The current mp4 of one camera: episodes' packets are appended with a time offset."""

    def __init__(self, path: Path, fps: int):
        self.path = path
        self.fps = fps
        self.container = None
        self.stream = None
        self.frames = 0
        self.bytes = 0

    def append(self, episode_mp4: Path, n_frames: int) -> tuple[float, float]:
        import av

        src = av.open(str(episode_mp4))
        try:
            in_stream = src.streams.video[0]
            if self.container is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.container = av.open(str(self.path), "w", format="mp4")
                self.stream = self.container.add_stream_from_template(in_stream, opaque=True)
            from_ts = self.frames / self.fps
            in_tb = in_stream.time_base
            for packet in src.demux(in_stream):
                if packet.dts is None and packet.pts is None:
                    continue
                off = int(round(from_ts / in_tb))
                if packet.pts is not None:
                    packet.pts += off
                if packet.dts is not None:
                    packet.dts += off
                packet.stream = self.stream
                self.bytes += packet.size
                self.container.mux(packet)
        finally:
            src.close()
        self.frames += n_frames
        return from_ts, self.frames / self.fps

    def close(self):
        if self.container is not None:
            self.container.close()
            self.container = None


class LeRobotWriter:
    """Record episodes into a new LeRobot v3.0 dataset directory (see the module docstring).

    features: {name: {"dtype": "video"|"image"?|"float32"|"int64"|"bool"|..., "shape": [...], "names": ...}} for the
    recorded features; the default columns (timestamp, frame_index, episode_index, index, task_index) are added.
    Video features must be uint8 (H, W, 3) frames. video_codec: "av1" (libsvtav1, lerobot's default), "h264" or
    "hevc"; see available_video_codecs().
    """

    def __init__(self, root: str | Path, fps: int, features: dict[str, dict], robot_type: str | None = None,
                 video_codec: str = "av1", chunks_size: int = 1000, data_files_size_in_mb: float = 100,
                 video_files_size_in_mb: float = 200, overwrite: bool = False, video_options: dict | None = None):
        self.root = Path(root)
        if self.root.exists() and any(self.root.iterdir()):
            if not overwrite:
                raise DatasetError(f"dataset directory already exists and is not empty: {self.root}")
            shutil.rmtree(self.root)
        if video_codec not in VIDEO_CODECS:
            from wamkit.core.errors import unknown_choice

            raise unknown_choice("video codec", video_codec, list(VIDEO_CODECS))
        if video_codec not in available_video_codecs():
            raise DatasetError(f"video codec {video_codec!r} has no encoder in this PyAV build; available: "
                               f"{', '.join(available_video_codecs())}")
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
        self._tmp = Path(tempfile.mkdtemp(prefix=".wamkit_episode_", dir=self.root))
        self._buffer: list[dict] = []
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict] = []
        self._episode_stats: list[dict] = []
        self.total_frames = 0
        self._data_loc = (0, 0)
        self._data_tables: list = []  # episodes already in the current data file
        self._video_files: dict[str, _VideoFile] = {}
        self._video_loc: dict[str, tuple[int, int]] = {k: (0, 0) for k in self.video_keys}
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
    def _next_loc(self, loc: tuple[int, int]) -> tuple[int, int]:
        c, f = loc
        f += 1
        if f >= self.chunks_size:
            c, f = c + 1, 0
        return c, f

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
            loc, from_ts, to_ts = self._write_episode_video(key, frames)
            ep[f"videos/{key}/chunk_index"], ep[f"videos/{key}/file_index"] = loc
            ep[f"videos/{key}/from_timestamp"], ep[f"videos/{key}/to_timestamp"] = from_ts, to_ts
        for key in self.data_keys + list(DEFAULT_FEATURES):
            stats[key] = numeric_stats(cols[key])
        data_loc = self._write_episode_data(cols)
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

    def _data_table(self, cols: dict[str, np.ndarray]):
        import pyarrow as pa

        arrays, fields = [], []
        for key in self.data_keys + list(DEFAULT_FEATURES):
            spec = self.features[key]
            v = cols[key]
            pa_type = pa.from_numpy_dtype(np.dtype(spec["dtype"]))
            if tuple(spec["shape"]) == (1,):
                arr = pa.array(v.reshape(-1), type=pa_type)
            else:
                width = int(np.prod(spec["shape"]))
                arr = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1), type=pa_type), width)
            arrays.append(arr)
            fields.append(pa.field(key, arr.type))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=self._hf_metadata()))

    def _hf_metadata(self) -> dict[bytes, bytes]:
        feats = {}
        for key in self.data_keys + list(DEFAULT_FEATURES):
            spec = self.features[key]
            value = {"dtype": spec["dtype"], "_type": "Value"}
            if tuple(spec["shape"]) == (1,):
                feats[key] = value
            else:
                feats[key] = {"feature": value, "length": int(np.prod(spec["shape"])), "_type": "List"}
        return {b"huggingface": json.dumps({"info": {"features": feats}}).encode()}

    def _write_episode_data(self, cols) -> tuple[int, int]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = self._data_table(cols)
        path = self.root / format_path(DATA_PATH, *self._data_loc)
        if self._data_tables and path.exists():
            cur_mb = path.stat().st_size / 2 ** 20
            if cur_mb + table.nbytes / 2 ** 20 >= self.data_files_size_in_mb:
                self._data_loc = self._next_loc(self._data_loc)
                self._data_tables = []
                path = self.root / format_path(DATA_PATH, *self._data_loc)
        self._data_tables.append(table)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(self._data_tables), path)
        return self._data_loc

    def _encode_episode(self, key: str, frames: np.ndarray) -> Path:
        import av

        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1: errors only, not its banner on every episode
        out = self._tmp / f"{key}.mp4"
        h, w = frames.shape[1:3]
        with av.open(str(out), "w", format="mp4") as c:
            s = c.add_stream(self.encoder, rate=self.fps, options={k: str(v) for k, v in self.video_options.items()})
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            s.codec_context.time_base = Fraction(1, self.fps)
            for i, img in enumerate(frames):
                f = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
                f.pts = i
                f.time_base = Fraction(1, self.fps)
                for p in s.encode(f):
                    c.mux(p)
            for p in s.encode(None):
                c.mux(p)
        return out

    def _write_episode_video(self, key: str, frames: np.ndarray):
        ep_file = self._encode_episode(key, frames)
        size_mb = ep_file.stat().st_size / 2 ** 20
        vf = self._video_files.get(key)
        if vf is not None and vf.frames > 0 and vf.bytes / 2 ** 20 + size_mb >= self.video_files_size_in_mb:
            vf.close()
            self._video_loc[key] = self._next_loc(self._video_loc[key])
            vf = None
        if vf is None:
            path = self.root / format_path(VIDEO_PATH, *self._video_loc[key], video_key=key)
            vf = self._video_files[key] = _VideoFile(path, self.fps)
        from_ts, to_ts = vf.append(ep_file, len(frames))
        ep_file.unlink()
        if "info" not in self.features[key]:
            h, w = frames.shape[1:3]
            self.features[key]["info"] = {
                "video.height": int(h), "video.width": int(w), "video.codec": self.video_codec,
                "video.pix_fmt": "yuv420p", "video.fps": self.fps, "video.channels": 3, "has_audio": False,
                "video.g": self.video_options.get("g"), "video.crf": self.video_options.get("crf"),
                "video.preset": self.video_options.get("preset"), "video.fast_decode": 0,
                "video.video_backend": "pyav", "video.extra_options": {}, "is_depth_map": False,
            }
        return self._video_loc[key], float(round(from_ts, 9)), float(round(to_ts, 9))

    # ------------------------------------------------------------------------------------------- finalize
    def finalize(self) -> Path:
        """Close video files and write meta/ (info.json, stats.json, tasks.parquet, episodes parquet)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._finalized:
            return self.root
        if self._buffer:
            raise DatasetError(f"finalize: {len(self._buffer)} frames added but not saved (call save_episode)")
        for vf in self._video_files.values():
            vf.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)

        # tasks.parquet: task string as the (pandas) index, written as column `task`
        tasks = sorted(self.tasks.items(), key=lambda kv: kv[1])
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
        t = pa.table({"task_index": pa.array([i for _, i in tasks], pa.int64()),
                      "task": pa.array([s for s, _ in tasks], pa.string())})
        pq.write_table(t.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()}),
                       meta / "tasks.parquet")

        # episodes parquet (one file) with flattened per-episode stats
        rows = []
        for ep, st in zip(self.episodes, self._episode_stats):
            row = dict(ep)
            for feat in self.features:
                if feat not in st:
                    continue
                for sk in STAT_KEYS:
                    row[f"stats/{feat}/{sk}"] = np.asarray(st[feat][sk]).tolist()
            row["meta/episodes/chunk_index"] = 0
            row["meta/episodes/file_index"] = 0
            rows.append(row)
        if rows:
            ep_path = self.root / format_path(EPISODES_PATH, 0, 0)
            ep_path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), ep_path)

        # stats.json
        agg = aggregate_stats(self._episode_stats) if self._episode_stats else {}
        (meta / "stats.json").write_text(json.dumps(stats_to_json(agg), indent=4))

        info = {
            "codebase_version": "v3.0",
            "fps": self.fps,
            "features": self.features,
            "total_episodes": len(self.episodes),
            "total_frames": self.total_frames,
            "total_tasks": len(self.tasks),
            "chunks_size": self.chunks_size,
            "data_files_size_in_mb": self.data_files_size_in_mb,
            "video_files_size_in_mb": self.video_files_size_in_mb,
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self.video_keys else None,
            "robot_type": self.robot_type,
            "splits": {"train": f"0:{len(self.episodes)}"},
        }
        (meta / "info.json").write_text(json.dumps(info, indent=4))
        self._finalized = True
        return self.root

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            for vf in self._video_files.values():
                vf.close()
            shutil.rmtree(self._tmp, ignore_errors=True)
