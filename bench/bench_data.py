"""Training-sample throughput: TrainingSamples + collate through a DataLoader, 2 cameras 256x256, chunk 16.

    .venv/bin/python bench/bench_data.py [--frames 300] [--batch 16] [--out bench/results/data.md]

Writes a dataset of its own (AV1 like lerobot, g=2), then measures frames/s for num_workers 0 and 2, reading order
shuffled (training) and sequential. lerobot's own loader: ~4 ms/frame on this kind of machine (reference number).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from wamkit.data.lerobot import LeRobotDataset
from wamkit.data.samples import ResumableShardedSampler, TrainingSamples, collate
from wamkit.data.transforms import ActionPipeline, QuantileNormalizeStep, Rot6dStep, compute_action_stats
from wamkit.data.writer import LeRobotWriter


def make_dataset(root: Path, frames: int, size: int = 256, episodes: int = 4) -> None:
    feats = {f"observation.images.{c}": {"dtype": "video", "shape": [size, size, 3]} for c in ("image", "wrist_image")}
    feats["observation.state"] = {"dtype": "float32", "shape": [8]}
    feats["action"] = {"dtype": "float32", "shape": [7]}
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    with LeRobotWriter(root, fps=10, features=feats, robot_type="panda") as w:
        per = frames // episodes
        for e in range(episodes):
            for i in range(per):
                img = np.stack([(xx + 3 * i) % 256, (yy + 5 * e) % 256, ((xx + yy + i) // 2) % 256], -1).astype(np.uint8)
                w.add_frame({"observation.images.image": img, "observation.images.wrist_image": img[::-1].copy(),
                             "observation.state": rng.normal(size=8).astype(np.float32),
                             "action": (rng.normal(size=7) * 0.3).astype(np.float32)})
            w.save_episode(f"task {e}")


def measure(root: Path, workers: int, shuffle: bool, batch: int, image_size: int) -> tuple[float, int]:
    ds = LeRobotDataset(root)
    st = compute_action_stats(ds, horizon=16, pipeline_before_norm=ActionPipeline([Rot6dStep()]))
    pipe = ActionPipeline([Rot6dStep(), QuantileNormalizeStep(st["q01"], st["q99"])])
    samples = TrainingSamples(ds, horizon=16, cameras=["image", "wrist_image"], image_size=image_size,
                              action_pipeline=pipe)
    sampler = ResumableShardedSampler(len(samples), seed=0, shuffle=shuffle, drop_last=True)
    loader = torch.utils.data.DataLoader(samples, batch_size=batch, sampler=sampler, collate_fn=collate,
                                         num_workers=workers, persistent_workers=False)
    t0 = time.perf_counter()  # includes worker start-up: an honest per-epoch number
    n = 0
    for b in loader:
        n += b["actions"].shape[0]
    return n / (time.perf_counter() - t0), n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--out", default="bench/results/data.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "bench_ds"
        t0 = time.perf_counter()
        make_dataset(root, args.frames)
        write_s = time.perf_counter() - t0
        for shuffle in (True, False):
            for workers in (0, 2):
                fps, n = measure(root, workers, shuffle, args.batch, args.image_size)
                rows.append((workers, "shuffled" if shuffle else "sequential", n, fps))
                print(f"workers={workers} order={'shuffled' if shuffle else 'sequential'}: {fps:.1f} frames/s "
                      f"({1000 / fps:.2f} ms/frame)", flush=True)
    cmd = "PYTHONPATH=src .venv/bin/python bench/bench_data.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# Data loading throughput", "",
        f"- command: `{cmd.strip()}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, no GPU",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- dataset: written by wamkit ({args.frames} frames, 4 episodes, 2 cameras 256x256 AV1 g=2 via libsvtav1; "
        f"written in {write_s:.1f} s)",
        f"- sample: 2 camera frames resized to {args.image_size}x{args.image_size} uint8, state, action chunk 16 "
        f"(rot6d + quantile normalization), batch {args.batch}; timings include DataLoader worker start-up",
        "- reference: lerobot's own loader, ~4 ms/frame on this kind of machine", "",
        "| DataLoader workers | order | samples | samples/s | ms/sample |", "|---:|---|---:|---:|---:|",
    ]
    for w, order, n, fps in rows:
        lines.append(f"| {w} | {order} | {n} | {fps:.1f} | {1000 / fps:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
