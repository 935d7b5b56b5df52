"""Camera frames of a LeRobot dataset: video files decoded with PyAV (`VideoDecoder`, one per file, pooled by
`VideoFrames`) and `image` feature cells (PNG/JPEG bytes or a path).

Frame lookup follows lerobot's rule: the decoded frame whose timestamp is closest to the query is returned if it lies
within ``tolerance_s`` of it (lerobot's default 1e-4 s), else FrameTimestampError. Decoding keeps one open container per
video file and continues from the last decoded frame when reading forward; it seeks (to the keyframe before the target)
only when going backwards or jumping more than ``max_forward_s`` ahead.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.data.errors import CorruptFileError, DatasetError, FrameTimestampError, MissingFileError
from wamkit.data.layout import inside


# Every open container, with the pid that opened it. A forked child (DataLoader worker) inherits this registry, so
# containers it inherited stay referenced there and are never freed in the child: freeing one would join decoder
# threads that do not exist in the child and hang (seen with dav1d). Only the owning process closes and unregisters.
_OPEN_CONTAINERS: dict[int, tuple[int, Any]] = {}
_INHERITED: list = []


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

        if not np.isfinite(t):   # a NaN distance compares False with the tolerance: the first cached frame came back
            raise FrameTimestampError(f"{self.path}: cannot read a frame at t={t} (not a finite time)")
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



class VideoFrames:
    """The open decoders of one dataset, one per video file; their counters; dropped when pickled (a DataLoader
    worker opens its own)."""

    def __init__(self, tolerance_s: float = 1e-4, cache_size: int = 16):
        self.tolerance_s, self.cache_size = float(tolerance_s), int(cache_size)
        self._decoders: dict[str, VideoDecoder] = {}

    def get(self, path: Path, t: float) -> np.ndarray:
        """The frame of video file `path` at t seconds (read-only: cached by the decoder)."""
        k = str(path)
        d = self._decoders.get(k)
        if d is None:
            d = self._decoders[k] = VideoDecoder(path, tolerance_s=self.tolerance_s, cache_size=self.cache_size)
        return d.get(t)

    def stats(self) -> dict[str, int]:
        """Decoder counters summed over files: opens, seeks, decoded frames."""
        ds = list(self._decoders.values())
        return {"opens": sum(d.opens for d in ds), "seeks": sum(d.seeks for d in ds),
                "decoded": sum(d.decoded for d in ds), "files": len(ds)}

    def close(self) -> None:
        for d in self._decoders.values():
            d.close()
        self._decoders.clear()

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_decoders"] = {}
        return d


def probe_video(path: Path) -> tuple[int, int]:
    """(height, width) of the first decoded frame of a video file; CorruptFileError if there is none."""
    return probe_stream(path)[:2]


def probe_stream(path: Path) -> tuple[int, int, float | None]:
    """(height, width) of the first decoded frame of a video file and its stream's frame rate (None when the
    container gives none); CorruptFileError if there is no frame."""
    import av

    if not Path(path).exists():
        raise MissingFileError(path, "video file")
    try:
        with av.open(str(path)) as c:
            if not c.streams.video:
                raise CorruptFileError(path, "no video stream")
            stream = c.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            for frame in c.decode(stream):
                return int(frame.height), int(frame.width), (float(rate) if rate else None)
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise CorruptFileError(path, f"cannot decode video: {str(e).splitlines()[0][:200]}") from None
    raise CorruptFileError(path, "no decodable video frame")



def decode_image_cell(cell: Any, root: Path) -> np.ndarray:
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
