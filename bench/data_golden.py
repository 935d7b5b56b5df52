"""Fingerprint of the LeRobot writer and reader: sha256 of every file the writer produces from a fixed seed (AV1 in
one file, AV1 rolled over many data/video files and chunks, H.264), and of every sample the reader returns from them
and from the lerobot-written fixture (forward, then backwards: seeks).

    PYTHONPATH=src python bench/data_golden.py before.json      # at the old commit
    PYTHONPATH=src python bench/data_golden.py after.json       # at the new one
    cmp before.json after.json                                  # identical: the refactor changed no byte

The encoders are deterministic for a given PyAV/FFmpeg build, so compare runs on the same machine and venv."""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from wamkit.data.lerobot import LeRobotDataset
from wamkit.data.writer import LeRobotWriter

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/lerobot_v3_libero_tiny"
CASES = [  # (name, codec, writer options)
    ("av1_one", "av1", {}),
    ("av1_roll", "av1", {"data_files_size_in_mb": 0.003, "video_files_size_in_mb": 0.01, "chunks_size": 2}),
    ("h264", "h264", {}),
]


def write(root: Path, n_episodes: int, codec: str, size: int = 32, **kw) -> None:
    feats = {
        "observation.images.image": {"dtype": "video", "shape": [size, size, 3],
                                     "names": ["height", "width", "channels"]},
        "observation.images.wrist_image": {"dtype": "video", "shape": [size, size, 3]},
        "observation.state": {"dtype": "float32", "shape": [8], "names": [f"s{i}" for i in range(8)]},
        "action": {"dtype": "float32", "shape": [7], "names": None},
        "flag": {"dtype": "bool", "shape": [1], "names": None},
    }
    rng = np.random.default_rng(1234)
    with LeRobotWriter(root, fps=10, features=feats, robot_type="panda", video_codec=codec, **kw) as w:
        for e in range(n_episodes):
            for i in range(10 + 3 * e):
                img = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
                w.add_frame({"observation.images.image": img, "observation.images.wrist_image": 255 - img,
                             "observation.state": rng.normal(size=8).astype(np.float32),
                             "action": rng.normal(size=7).astype(np.float32), "flag": bool(i % 2)})
            w.save_episode(f"task {e % 3}")


def hash_dir(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def hash_samples(ds: LeRobotDataset, rows: list[int]) -> list[str]:
    """One digest per sample: every key, type, dtype, shape and byte of ds[i], and its action chunk."""
    out = []
    for i in rows:
        item = ds[i]
        h = hashlib.sha256()
        for k in sorted(item):
            v = item[k]
            h.update(k.encode())
            h.update(repr(type(v)).encode())
            if isinstance(v, np.ndarray):
                h.update(str(v.dtype).encode())
                h.update(str(v.shape).encode())
                h.update(np.ascontiguousarray(v).tobytes())
            else:
                h.update(repr(v).encode())
        a, m = ds.get_action_chunk(i, 16)
        h.update(a.tobytes())
        h.update(m.tobytes())
        out.append(h.hexdigest())
    return out


def main(out: str) -> None:
    res: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for name, codec, kw in CASES:
            root = Path(d) / name
            write(root, 5, codec, **kw)
            res[f"write/{name}"] = hash_dir(root)
            ds = LeRobotDataset(root)
            n = len(ds)
            res[f"read/{name}"] = hash_samples(ds, list(range(n)) + list(range(n - 1, -1, -3)))   # forward, back
            res[f"read/{name}/stats"] = [ds.stats, repr(ds.episode_stats()), repr(ds.episodes), ds.cameras,
                                         ds.num_frames]
            res[f"read/{name}/rows"] = [ds.episode_rows(e) for e in range(ds.num_episodes)]
        ds = LeRobotDataset(FIXTURE)
        n = len(ds)
        res["read/fixture"] = hash_samples(ds, list(range(n)) + [n - 1, 3, 40, 0, 17])
        res["read/fixture/video_stats"] = ds.video_stats()
        res["read/fixture/verify"] = ds.verify_videos()
    Path(out).write_text(json.dumps(res, indent=1, sort_keys=True, default=str))
    print("ok", sum(len(v) for v in res.values() if isinstance(v, (dict, list))), "digests ->", out)


if __name__ == "__main__":
    main(sys.argv[1])
