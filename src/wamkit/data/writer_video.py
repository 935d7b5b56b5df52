"""The video side of the LeRobot writer: encode each episode on its own (starting on a keyframe), then append its
packets to the camera's current mp4 (`from_timestamp` = frames already in that file / fps); a new file starts when the
current one would pass `files_size_in_mb`, a new chunk every `chunks_size` files."""

from __future__ import annotations

import os
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np

from wamkit.data.errors import DatasetError
from wamkit.data.layout import VIDEO_PATH, format_path, next_file

# codec name in info.json -> (PyAV encoder, encoder options). No B-frames (bf=0) for x264/x265: with them an
# episode's first packet is decoded a frame before it is shown (dts < pts), and appended after a 1-frame episode
# (dts == pts) its dts went backwards, which the mp4 muxer refuses. x265 logs errors only (not ~22 banner lines an
# episode).
VIDEO_CODECS = {
    "av1": ("libsvtav1", {"g": 2, "crf": 30, "preset": 12}),
    "h264": ("libx264", {"g": 2, "crf": 23, "preset": "veryfast", "bf": 0}),
    "hevc": ("libx265", {"g": 2, "crf": 28, "preset": "veryfast", "bf": 0, "x265-params": "log-level=error"}),
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


def check_video_codec(codec: str) -> None:
    """A known codec with an encoder in this PyAV build, else one error naming the choices."""
    if codec not in VIDEO_CODECS:
        from wamkit.core.errors import unknown_choice

        raise unknown_choice("video codec", codec, list(VIDEO_CODECS))
    if codec not in available_video_codecs():
        raise DatasetError(f"video codec {codec!r} has no encoder in this PyAV build; available: "
                           f"{', '.join(available_video_codecs())}")


def mend_dts(packets: list, n_frames: int) -> bool:
    """Give an episode's packets (in decode order, pts 0..n-1 in frames) a valid decode timeline where the encoder's
    is not: every dts set, rising, at most its pts and no further back than the episode's length. libx265 with
    B-frames gives an episode shorter than its B-frame delay an unset dts (a 1-frame episode: values like
    -7.9e15 that depend on memory contents), which the mp4 muxer refuses ("pts/dts pair unsupported"). The mended
    dts are the sorted pts shifted back by the stream's largest reorder, the standard layout. True if mended."""
    pts = [p.pts for p in packets]
    dts = [p.dts for p in packets]
    if None in pts:
        return False   # nothing to derive a timeline from: the muxer's own error names it
    if None not in dts and all(d <= t and d >= -n_frames for d, t in zip(dts, pts)) \
            and all(a < b for a, b in zip(dts, dts[1:])):
        return False
    order = sorted(pts)
    shift = max(0, max(o - t for o, t in zip(order, pts)))
    for p, o in zip(packets, order):
        p.dts = o - shift
    return True


class Mp4Appender:
    """The current mp4 of one camera: episodes' packets are appended with a time offset."""

    def __init__(self, path: Path, fps: int):
        self.path = path
        self.fps = fps
        self.container = None
        self.stream = None
        self.frames = 0
        self.bytes = 0
        self._last_dts = None   # of the last packet muxed, in the episodes' time base

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
                    if self._last_dts is not None and packet.dts <= self._last_dts < packet.pts:
                        packet.dts = self._last_dts + 1   # reordered frames (options with B-frames): keep dts rising
                    self._last_dts = packet.dts
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


class EpisodeVideoWriter:
    """The video files of every video feature of one dataset being written. Episodes are encoded into `tmp` (a
    directory this writer removes on close) and appended to the feature's current file under `root`."""

    def __init__(self, root: Path, tmp: Path, fps: int, codec: str, options: dict, chunks_size: int,
                 files_size_in_mb: float, keys: list[str]):
        self.root, self.tmp, self.fps, self.codec = root, tmp, fps, codec
        self.encoder = VIDEO_CODECS[codec][0]
        self.options = options
        self.chunks_size, self.files_size_in_mb = chunks_size, files_size_in_mb
        self._files: dict[str, Mp4Appender] = {}
        self._loc: dict[str, tuple[int, int]] = {k: (0, 0) for k in keys}

    def encode(self, key: str, frames: np.ndarray) -> Path:
        """One episode of uint8 (T, H, W, 3) frames -> a temporary mp4 starting on a keyframe."""
        import av

        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1: errors only, not its banner on every episode
        out = self.tmp / f"{key}.mp4"
        h, w = frames.shape[1:3]
        with av.open(str(out), "w", format="mp4") as c:
            s = c.add_stream(self.encoder, rate=self.fps, options={k: str(v) for k, v in self.options.items()})
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            s.codec_context.time_base = Fraction(1, self.fps)
            packets = []
            for i, img in enumerate(frames):
                f = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
                f.pts = i
                f.time_base = Fraction(1, self.fps)
                packets += s.encode(f)
            packets += s.encode(None)
            mend_dts(packets, len(frames))
            for p in packets:
                c.mux(p)
        return out

    def write_episode(self, key: str, frames: np.ndarray,
                      episode_index: int = 0) -> tuple[tuple[int, int], float, float]:
        """Encode and append one episode: ((chunk_index, file_index), from_timestamp, to_timestamp); an FFmpeg
        error is a DatasetError naming the file and the episode."""
        import av

        try:
            return self._write_episode(key, frames)
        except av.error.FFmpegError as e:
            path = self.root / format_path(VIDEO_PATH, *self._loc[key], video_key=key)
            raise DatasetError(f"{path}: cannot write episode {episode_index} of {key} "
                               f"({str(e).splitlines()[0][:200]})") from None

    def _write_episode(self, key: str, frames: np.ndarray) -> tuple[tuple[int, int], float, float]:
        ep_file = self.encode(key, frames)
        size_mb = ep_file.stat().st_size / 2 ** 20
        vf = self._files.get(key)
        if vf is not None and vf.frames > 0 and vf.bytes / 2 ** 20 + size_mb >= self.files_size_in_mb:
            vf.close()
            self._loc[key] = next_file(self._loc[key], self.chunks_size)
            vf = None
        if vf is None:
            path = self.root / format_path(VIDEO_PATH, *self._loc[key], video_key=key)
            vf = self._files[key] = Mp4Appender(path, self.fps)
        from_ts, to_ts = vf.append(ep_file, len(frames))
        ep_file.unlink()
        return self._loc[key], float(round(from_ts, 9)), float(round(to_ts, 9))

    def feature_info(self, height: int, width: int) -> dict:
        """The `info` block of a video feature in info.json (lerobot's keys)."""
        return {
            "video.height": int(height), "video.width": int(width), "video.codec": self.codec,
            "video.pix_fmt": "yuv420p", "video.fps": self.fps, "video.channels": 3, "has_audio": False,
            "video.g": self.options.get("g"), "video.crf": self.options.get("crf"),
            "video.preset": self.options.get("preset"), "video.fast_decode": 0,
            "video.video_backend": "pyav", "video.extra_options": {}, "is_depth_map": False,
        }

    def close(self) -> None:
        """Close the current files and remove the temporary directory. Idempotent."""
        for vf in self._files.values():
            vf.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
