"""wam-ref inference cost on CPU: time per observation vs batch size, plus the nano-shape model's size and FLOPs.

    .venv/bin/python bench/bench_policy.py                      # tiny + small, batches 1,2,4,8,16 -> bench/results/policy.md
    .venv/bin/python bench/bench_policy.py --sizes tiny --batches 1,4 --repeats 2 --out /tmp/policy.md

Each row: median over `repeats` timed `predict` calls (after one warm-up) of a batch of distinct observations (random
256x256 images for both cameras, LIBERO-like task strings), `num_inference_steps` Euler steps. Wall clock on a CPU
that may be shared with other processes: read the numbers as an upper bound.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from wamkit.core.types import Observation
from wamkit.policies import make_policy

TASKS = ["put the bowl on the plate", "open the top drawer and put the bowl inside", "pick up the ketchup and "
         "place it in the basket", "turn on the stove and put the moka pot on it"]


def observations(n: int, seed: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    return [Observation(images={c: rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
                                for c in ("image", "wrist_image")}, state=None, task=TASKS[i % len(TASKS)])
            for i in range(n)]


def bench_size(size: str, batches: list[int], repeats: int, steps: int) -> list[dict]:
    pol = make_policy("wam-ref", size=size, num_inference_steps=steps)
    params = pol.num_parameters()["total"]
    rows = []
    for b in batches:
        obs = observations(b, seed=b)
        seeds = list(range(b))
        pol.predict(obs, seeds)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pol.predict(obs, seeds)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rows.append({"size": size, "params": params, "batch": b, "ms_batch": med * 1e3, "ms_obs": med * 1e3 / b,
                     "obs_s": b / med, "prefix_len": pol.prefix_len})
        print(f"{size:6s} batch {b:3d}: {med * 1e3:9.1f} ms/batch {med * 1e3 / b:8.1f} ms/obs {b / med:7.2f} obs/s",
              flush=True)
    return rows


def nano_report(steps: int = 30, prefix_len: int = 316) -> dict:
    pol = make_policy("wam-ref", size="nano-shape", device="meta", dtype="bfloat16")
    counts = pol.num_parameters()
    f = pol.flops_per_observation(num_inference_steps=steps, prefix_len=prefix_len)
    f_own = pol.flops_per_observation(num_inference_steps=steps)
    return {"counts": counts, "flops": f, "flops_own_prefix": f_own}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "policy.md"))
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(x) for x in a.batches.split(",")]
    rows = []
    for size in a.sizes.split(","):
        rows += bench_size(size, batches, a.repeats, a.steps)
    nano = nano_report()
    c, f = nano["counts"], nano["flops"]
    print(f"nano-shape: {c['total'] / 1e9:.3f}B params (und {c['und'] / 1e9:.3f}B, gen {c['gen'] / 1e9:.3f}B); "
          f"{f['total'] / 1e12:.2f} TFLOP/observation (prefix {f['prefix_len']} tokens, {f['steps']} steps)")
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    cmd = "python bench/bench_policy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# wam-ref inference on CPU",
        "",
        f"- command: `{cmd.strip()}`",
        f"- date: {dt.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}",
        f"- load average at the end: {load}  (the CPU was shared with other processes: numbers are upper bounds)",
        f"- {a.steps} Euler steps, horizon 16, 2 cameras; median of {a.repeats} calls after a warm-up; the "
        "understanding prefix runs once per observation per call",
        "",
        "| size | params | prefix tokens | batch | ms / batch | ms / observation | observations / s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.2f}M | {r['prefix_len']} | {r['batch']} | "
                     f"{r['ms_batch']:.1f} | {r['ms_obs']:.1f} | {r['obs_s']:.2f} |")
    fo = nano["flops_own_prefix"]
    lines += [
        "",
        "## nano-shape (Cosmos3-Nano tower shape; built on the meta device, nothing allocated)",
        "",
        f"- parameters: {c['total']:,} total = understanding {c['und']:,} (vision {c['und_vision']:,}, text "
        f"{c['und_text']:,} of which embeddings {c['und_text_embed']:,}) + generation {c['gen']:,}",
        f"- forward FLOPs per observation, 30 steps, 316-token prefix (the reference measurement's shape): "
        f"{f['total'] / 1e12:.2f} TFLOP (vision {f['vision'] / 1e12:.2f}, prefix {f['und_prefix'] / 1e12:.2f}, "
        f"{f['gen_per_step'] / 1e12:.3f} per denoising step)",
        f"- with wam-ref's own nano-shape prefix ({fo['prefix_len']} tokens: 2 x 64 image tokens + markers + 128 "
        f"text): {fo['total'] / 1e12:.2f} TFLOP per observation",
        "- /work/shared/reference/machines.md measured ~11 TFLOP per observation for this shape on an H200.",
        "",
    ]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
