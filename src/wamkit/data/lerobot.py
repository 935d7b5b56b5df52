"""Read LeRobot v3.0 datasets with pyarrow + PyAV (no lerobot import).

    ds = LeRobotDataset("path/to/dataset", cameras=["image", "wrist_image"], check_fps=10)
    item = ds[0]   # {"observation.images.image": uint8 (H,W,3), "action": f32 (7,), "observation.state": ..., "task": str,
                   #  "episode_index", "frame_index", "timestamp", "index", "task_index"}
    actions, mask = ds.get_action_chunk(0, horizon=16)

Layout (LeRobot v3.0, see docs/data.md): meta/info.json, meta/stats.json, meta/tasks.parquet,
meta/episodes/chunk-XXX/file-YYY.parquet, data/chunk-XXX/file-YYY.parquet, videos/<key>/chunk-XXX/file-YYY.mp4.
Episodes share mp4 files; the frame of a row is at ``videos/<key>/from_timestamp + timestamp`` in its episode's file.

Frame lookup follows lerobot's rule: the decoded frame whose timestamp is closest to the query is returned if it lies
within ``tolerance_s`` of it (lerobot's default 1e-4 s), else FrameTimestampError. Decoding keeps one open container per
video file and continues from the last decoded frame when reading forward; it seeks (to the keyframe before the target)
only when going backwards or jumping more than ``max_forward_s`` ahead.
"""

from __future__ import annotations

import json
import math
import os
import string
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from wamkit.data.errors import (
    CorruptFileError, DatasetError, FeatureMissingError, FpsMismatchError, FrameTimestampError, MissingFileError,
)

# Every open container, with the pid that opened it. A forked child (DataLoader worker) inherits this registry, so
# containers it inherited stay referenced there and are never freed in the child: freeing one would join decoder
# threads that do not exist in the child and hang (seen with dav1d). Only the owning process closes and unregisters.
_OPEN_CONTAINERS: dict[int, tuple[int, Any]] = {}
_INHERITED: list = []

DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")
CAMERA_PREFIX = "observation.images."


TEMPLATE_FIELDS = ("chunk_index", "file_index", "episode_chunk", "episode_file", "video_key")


def format_path(template: str, chunk_index: int, file_index: int, video_key: str | None = None) -> str:
    """Fill a v3 path template; accepts both `{chunk_index}/{file_index}` and `{episode_chunk}/{episode_file}`."""
    return template.format(chunk_index=int(chunk_index), file_index=int(file_index), episode_chunk=int(chunk_index),
                           episode_file=int(file_index), video_key=video_key)


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
    return None


def inside(root: Path, rel: str, what: str) -> Path:
    """root / rel, refused (DatasetError) when rel is absolute or climbs out of root (`../`). Lexical: a symlink the
    user placed inside the dataset is followed as usual."""
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep) or os.path.isabs(norm):
        raise DatasetError(f"{root}: {what} {rel!r} points outside the dataset directory; refused")
    return root / norm


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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


def column_to_numpy(col, shape: Sequence[int] | None = None) -> np.ndarray | list:
    """A pyarrow column -> numpy (fixed/variable lists become (N, ...) arrays); strings -> list[str]."""
    import pyarrow as pa

    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return arr.to_pylist()
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        n = len(arr)
        flat = arr
        while pa.types.is_fixed_size_list(flat.type) or pa.types.is_list(flat.type) or \
                pa.types.is_large_list(flat.type):
            flat = flat.flatten()
        vals = flat.to_numpy(zero_copy_only=False)
        if shape is not None and int(np.prod(shape)) * n == vals.size:
            return vals.reshape(n, *shape)
        return vals.reshape(n, -1)
    return arr.to_numpy(zero_copy_only=False)


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
    return {int(i): str(s) for i, s in zip(t.column("task_index").to_pylist(), t.column(key).to_pylist())}


class VideoDecoder:
    """One video file, decoded forward with state kept between calls (open container, last decoded time, small cache).

    `get(t)` returns the uint8 (H, W, 3) RGB frame nearest to t (seconds), within `tolerance_s`.
    Counters: `opens`, `seeks`, `decoded` (frames pulled out of the decoder).
    """

    def __init__(self, path: str | Path, tolerance_s: float = 1e-4, cache_size: int = 16, max_forward_s: float = 1.0):
        self.path = Path(path)
        self.tolerance_s = float(tolerance_s)
        self.cache_size = int(cache_size)
        self.max_forward_s = float(max_forward_s)
        self.opens = 0
        self.seeks = 0
        self.decoded = 0
        self._reset_state()

    def _reset_state(self):
        if getattr(self, "_container", None) is not None and getattr(self, "_pid", None) != os.getpid():
            # inherited through fork: keep the container and its decode generator alive, unused (see above)
            _INHERITED.append((self._container, self._stream, self._iter))
        self._container = None
        self._stream = None
        self._iter = None
        self._last = -np.inf  # time of the last decoded frame
        self._exhausted = False
        self._cache: OrderedDict[float, np.ndarray] = OrderedDict()
        self._pid = os.getpid()

    def __getstate__(self):
        d = self.__dict__.copy()
        for k in ("_container", "_stream", "_iter"):
            d[k] = None
        d["_cache"] = OrderedDict()
        d["_last"] = -np.inf
        d["_exhausted"] = False
        return d

    def _open(self):
        import av

        if not self.path.exists():
            raise MissingFileError(self.path, "video file")
        try:
            self._container = av.open(str(self.path))
            _OPEN_CONTAINERS[id(self._container)] = (os.getpid(), self._container)
            self._stream = self._container.streams.video[0]
        except (av.error.FFmpegError, IndexError, OSError) as e:
            self.close()
            raise CorruptFileError(self.path, f"cannot open video: {e}") from None
        self._stream.thread_type = "AUTO"
        self._iter = self._container.decode(self._stream)
        self._last = -np.inf
        self._exhausted = False
        self.opens += 1

    def _seek(self, t: float):
        tb = self._stream.time_base
        target = int(max(t - self.tolerance_s, 0.0) / float(tb))
        self._container.seek(target, stream=self._stream, backward=True, any_frame=False)
        self._iter = self._container.decode(self._stream)
        self._last = -np.inf
        self._exhausted = False
        self.seeks += 1

    def close(self):
        if self._container is not None and self._pid == os.getpid():
            self._iter = None
            _OPEN_CONTAINERS.pop(id(self._container), None)
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - closing a broken container must not mask the real error
                pass
        self._reset_state()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _nearest_cached(self, t: float):
        if not self._cache:
            return None, np.inf
        times = np.fromiter(self._cache.keys(), dtype=np.float64)
        j = int(np.argmin(np.abs(times - t)))
        return float(times[j]), float(abs(times[j] - t))

    def get(self, t: float) -> np.ndarray:
        import av

        if self._pid != os.getpid():  # forked into a DataLoader worker: do not share the parent's container
            self._reset_state()
        tol = self.tolerance_s
        ft, dist = self._nearest_cached(t)
        if dist < tol:
            self._cache.move_to_end(ft)
            return self._cache[ft]
        if self._container is None:
            self._open()
        if self._last == -np.inf:
            need_seek = t > self.max_forward_s  # fresh decoder sits at the start of the file
        else:
            need_seek = t < self._last - tol or t > self._last + self.max_forward_s
        if need_seek:
            self._seek(t)
        try:
            while not self._exhausted and self._last < t - tol:
                try:
                    frame = next(self._iter)
                except StopIteration:
                    self._exhausted = True
                    break
                self.decoded += 1
                if frame.pts is None:
                    continue
                ftime = float(frame.pts * frame.time_base)
                self._last = ftime
                if ftime >= t - tol - 1e-9 or abs(ftime - t) < tol:
                    arr = frame.to_ndarray(format="rgb24")
                    arr.flags.writeable = False  # cached: callers get copies (LeRobotDataset.get_frame)
                    self._cache[ftime] = arr
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        except av.error.FFmpegError as e:
            self.close()
            raise CorruptFileError(self.path, f"cannot decode video at t={t:.4f}s: {e}") from None
        ft, dist = self._nearest_cached(t)
        if ft is None or dist >= tol:
            near = "no frame" if ft is None else f"nearest decoded frame at {ft:.4f}s"
            raise FrameTimestampError(
                f"{self.path}: no frame within {tol}s of t={t:.4f}s ({near}); the video may be truncated or the "
                f"episode's from_timestamp/timestamps inconsistent")
        return self._cache[ft]


class LeRobotDataset:
    """A LeRobot v3.0 dataset on local disk, read with pyarrow + PyAV.

    root: dataset directory (with meta/, data/, videos/).
    cameras: video/image features to decode (`observation.images.<cam>` or just `<cam>`); None = all.
    check_fps: expected fps (from a config); a different dataset fps raises FpsMismatchError unless
        allow_fps_mismatch=True.
    required_features: feature names that must exist (FeatureMissingError names the missing one).
    tolerance_s: max distance between a query timestamp and the decoded frame (lerobot's default 1e-4 s).
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
        self._video_cache_size = int(video_cache_size)

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
        self.episodes: list[dict] = self._read_episodes()
        self._episode_by_index = {int(e["episode_index"]): e for e in self.episodes}
        self._load_data()
        self._check_video_files()
        self._decoders: dict[str, VideoDecoder] = {}

    # ------------------------------------------------------------------------------------------- metadata
    def _read_episodes(self) -> list[dict]:
        ep_dir = self.root / "meta" / "episodes"
        files = sorted(ep_dir.glob("chunk-*/file-*.parquet"))
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

    @property
    def stats(self) -> dict:
        """meta/stats.json ({} when absent)."""
        p = self.root / "meta" / "stats.json"
        return read_json(p) if p.exists() else {}

    def episode_stats(self) -> list[dict]:
        """Per-episode `stats/<feature>/<stat>` columns of the episodes parquet, one dict per episode."""
        out = []
        for f in sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet")):
            t = read_parquet(f, "episodes metadata file")
            keep = ["episode_index"] + [c for c in t.column_names if c.startswith("stats/")]
            out.extend(t.select(keep).to_pylist())
        return sorted(out, key=lambda r: r["episode_index"])

    # ------------------------------------------------------------------------------------------- data
    def _data_files(self) -> list[Path]:
        seen: list[tuple[int, int]] = []
        for e in self.episodes:
            key = (int(e["data/chunk_index"]), int(e["data/file_index"]))
            if key not in seen:
                seen.append(key)
        return [inside(self.root, format_path(self.info["data_path"], c, f), "data file") for c, f in seen]

    def _load_data(self):
        import pyarrow as pa

        tables = [read_parquet(p, "data file") for p in self._data_files()]
        try:
            table = pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
        except pa.ArrowInvalid as e:
            raise DatasetError(f"{self.root}: data files have incompatible schemas: {e}") from None
        self._columns: dict[str, Any] = {}
        info_path = self.root / "meta" / "info.json"
        for name in table.column_names:
            feat = self.features.get(name, {})
            if feat.get("dtype") in ("video",):
                continue
            shape = feat.get("shape")
            try:
                col = column_to_numpy(table.column(name), shape if shape and shape != [1] else None)
            except ValueError:   # rows of different lengths
                raise DatasetError(f"{info_path}: field 'features.{name}.shape' declares {shape} but the rows of "
                                   f"column {name!r} in the data files differ in length") from None
            if shape and isinstance(col, np.ndarray) and feat.get("dtype") != "image":
                got = [int(d) for d in col.shape[1:]] or [1]
                if got != list(shape) and not (list(shape) == [1] and got == [1]):
                    raise DatasetError(f"{info_path}: field 'features.{name}.shape' declares {shape} but the data "
                                       f"files hold {got} per row")
            self._columns[name] = col
        absent = [k for k, f in self.features.items() if f["dtype"] != "video" and k not in self._columns]
        if absent:
            raise DatasetError(f"{info_path}: field 'features.{absent[0]}' is declared but the data files have no "
                               f"such column")
        for need in ("episode_index", "frame_index", "timestamp", "index"):
            if need not in self._columns:
                raise DatasetError(f"{self.root}: data files lack the {need!r} column")
        order = np.argsort(self._columns["index"], kind="stable")
        if not np.all(order == np.arange(len(order))):
            self._columns = {k: (v[order] if isinstance(v, np.ndarray) else [v[i] for i in order])
                             for k, v in self._columns.items()}
        ep = np.asarray(self._columns["episode_index"])
        n = len(ep)
        # last row of each row's episode (episodes are contiguous runs of rows)
        change = np.flatnonzero(np.diff(ep) != 0)
        ends = np.append(change, n - 1)
        run_id = np.concatenate([[0], np.cumsum(np.diff(ep) != 0)]) if n else np.zeros(0, int)
        self._ep_last_row = ends[run_id] if n else np.zeros(0, int)
        self._num_frames = n
        expected = self.info.get("total_frames")
        if expected is not None and int(expected) != n:
            raise DatasetError(f"{self.root}: info.json says total_frames={expected} but the data files hold {n} rows")

    def _video_path(self, key: str, episode: dict) -> Path:
        c = episode.get(f"videos/{key}/chunk_index")
        f = episode.get(f"videos/{key}/file_index")
        if c is None or f is None:
            raise DatasetError(f"{self.root}: episode {episode['episode_index']} has no video location for {key!r}")
        if not isinstance(c, int) or not isinstance(f, int) or c < 0 or f < 0:
            raise DatasetError(f"{self.root}: episode {episode['episode_index']}: videos/{key}/chunk_index and "
                               f"file_index must be integers >= 0, got {c!r}, {f!r}")
        return inside(self.root, format_path(self.info["video_path"], c, f, video_key=key), "video file")

    def _check_video_files(self):
        for key in self.video_keys:
            seen = set()
            for e in self.episodes:
                t0 = e.get(f"videos/{key}/from_timestamp")
                if not _is_number(t0) or t0 < 0:
                    raise DatasetError(f"{self.root}/meta/episodes: episode {e['episode_index']}: column "
                                       f"'videos/{key}/from_timestamp' must be a number >= 0, got {t0!r}")
                p = self._video_path(key, e)
                if p not in seen:
                    seen.add(p)
                    if not p.exists():
                        raise MissingFileError(p, f"video file for {key}")

    def verify_videos(self) -> int:
        """Open every video file of the selected cameras and decode its first frame: a garbage, empty or truncated
        mp4, or frames of another size than the feature's shape, raise (CorruptFileError / DatasetError, naming the
        file). Returns the number of files checked."""
        checked = 0
        for key in self.video_keys:
            seen = set()
            for e in self.episodes:
                p = self._video_path(key, e)
                if p in seen:
                    continue
                seen.add(p)
                h, w = probe_video(p)
                want = self.features[key]["shape"][:2]
                if [h, w] != list(want):
                    raise DatasetError(f"{p}: frames are {h}x{w} but features.{key}.shape declares {want[0]}x{want[1]}")
                checked += 1
        return checked

    # ------------------------------------------------------------------------------------------- access
    def __len__(self) -> int:
        return self._num_frames

    @property
    def num_frames(self) -> int:
        return self._num_frames

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def cameras(self) -> list[str]:
        """Short camera names (`observation.images.<cam>` -> `<cam>`) of the selected camera features."""
        return [k[len(CAMERA_PREFIX):] if k.startswith(CAMERA_PREFIX) else k for k in self.camera_keys]

    def column(self, name: str) -> np.ndarray:
        """A whole non-video column as numpy (e.g. `ds.column("action")` -> (N, 7))."""
        if name not in self._columns:
            raise FeatureMissingError(f"{self.root}: column {name!r} not in dataset; available: "
                                      f"{', '.join(self._columns)}")
        return self._columns[name]

    def _decoder(self, path: Path) -> VideoDecoder:
        k = str(path)
        d = self._decoders.get(k)
        if d is None:
            d = self._decoders[k] = VideoDecoder(path, tolerance_s=self.tolerance_s, cache_size=self._video_cache_size)
        return d

    def video_stats(self) -> dict[str, int]:
        """Decoder counters summed over files: opens, seeks, decoded frames."""
        ds = list(self._decoders.values())
        return {"opens": sum(d.opens for d in ds), "seeks": sum(d.seeks for d in ds),
                "decoded": sum(d.decoded for d in ds), "files": len(ds)}

    def close(self):
        for d in self._decoders.values():
            d.close()
        self._decoders.clear()

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_decoders"] = {}
        return d

    def get_frame(self, i: int, key: str) -> np.ndarray:
        """uint8 (H, W, 3) image of camera feature `key` at row i."""
        ep = self._episode_by_index[int(self._columns["episode_index"][i])]
        feat = self.features[key]
        if feat["dtype"] == "image":
            return _decode_image_cell(self._columns[key][i], self.root)
        t = float(ep[f"videos/{key}/from_timestamp"]) + float(self._columns["timestamp"][i])
        return self._decoder(self._video_path(key, ep)).get(t).copy()

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = self._num_frames
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
        i = int(i)
        last = int(self._ep_last_row[i])
        want = np.arange(i, i + int(horizon))
        rows = np.minimum(want, last)
        return self.column(key)[rows], want <= last

    def episode_rows(self, episode_index: int) -> tuple[int, int]:
        """[start, end) rows of an episode."""
        ep = np.asarray(self._columns["episode_index"])
        rows = np.flatnonzero(ep == int(episode_index))
        if rows.size == 0:
            raise DatasetError(f"{self.root}: no episode {episode_index}")
        return int(rows[0]), int(rows[-1]) + 1

    def __repr__(self) -> str:
        return (f"LeRobotDataset({str(self.root)!r}, episodes={self.num_episodes}, frames={len(self)}, fps={self.fps}, "
                f"cameras={self.cameras})")


def probe_video(path: Path) -> tuple[int, int]:
    """(height, width) of the first decoded frame of a video file; CorruptFileError if there is none."""
    import av

    if not Path(path).exists():
        raise MissingFileError(path, "video file")
    try:
        with av.open(str(path)) as c:
            if not c.streams.video:
                raise CorruptFileError(path, "no video stream")
            for frame in c.decode(c.streams.video[0]):
                return int(frame.height), int(frame.width)
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise CorruptFileError(path, f"cannot decode video: {str(e).splitlines()[0][:200]}") from None
    raise CorruptFileError(path, "no decodable video frame")


def _decode_image_cell(cell: Any, root: Path) -> np.ndarray:
    """An `image` feature cell ({bytes, path} struct) -> uint8 (H, W, 3)."""
    import io

    from PIL import Image

    if isinstance(cell, dict):
        data = cell.get("bytes")
        if data is None and cell.get("path"):
            p = inside(root, str(cell["path"]), "image path")
            if not p.exists():
                raise MissingFileError(p, "image file")
            data = p.read_bytes()
        if data is None:
            raise DatasetError("image cell holds neither bytes nor path")
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return np.asarray(cell, dtype=np.uint8)
