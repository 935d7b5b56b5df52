"""Episode videos (mp4, H.264 yuv420p through PyAV: plays in browsers, Debian's chromium included).

Observations are often small (a policy trained at 64 px); a video is for a person to judge, so frames smaller than
MIN_VIDEO_SIZE are enlarged by a whole factor (nearest neighbour: the pixels the policy saw, bigger)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MIN_VIDEO_SIZE = 224   # px, the shorter side of a written video


def upscale(frame: np.ndarray, min_size: int = MIN_VIDEO_SIZE) -> np.ndarray:
    """Enlarge by the smallest whole factor that makes the shorter side >= min_size (unchanged if it already is)."""
    short = min(frame.shape[:2])
    k = -(-min_size // short) if 0 < short < min_size else 1
    return frame if k == 1 else np.repeat(np.repeat(frame, k, axis=0), k, axis=1)


def write_mp4(path: str | Path, frames: list[np.ndarray], fps: float = 20.0,
              min_size: int = MIN_VIDEO_SIZE) -> Path:
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = [upscale(f, min_size) for f in frames]
    h, w = frames[0].shape[:2]
    h2, w2 = h - h % 2, w - w % 2   # yuv420p needs even sizes
    # faststart: the index up front, so a browser can start playing before it has the whole file
    with av.open(str(path), mode="w", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.width, stream.height, stream.pix_fmt = w2, h2, "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast"}
        for f in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(f[:h2, :w2, :3]), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
