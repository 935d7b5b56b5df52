"""The scheduler table on real LIBERO (issue: pipelined evaluation), at two scales "N episodes, M envs".

    .venv/bin/python bench/bench_eval.py [--scales 4x2,8x4] [--max-steps 96] [--out runs/bench_eval]

Policy: `fixed-cost` (random actions, scale 0.3) with a known inference cost of base_ms + per_obs_ms * N per batch,
slept (the CPU stays free, as with a GPU): comparable to one chunk of 16 simulated steps with render skipping.
Every row runs the same episode plan; `wamkit bench eval` does the work (see src/wamkit/eval/bench.py).
Writes bench/results/eval.md (appends a dated section)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from _common import cpu_model  # noqa: E402  (bench/ is on sys.path when run as a script)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scales", default="4x2,8x4", help="comma list of EPISODESxENVS")
    ap.add_argument("--suite", default="libero_object")
    ap.add_argument("--max-steps", type=int, default=96)
    ap.add_argument("--base-ms", type=float, default=200.0)
    ap.add_argument("--per-obs-ms", type=float, default=10.0)
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--out", default="runs/bench_eval")
    ap.add_argument("--results", default=str(ROOT / "bench/results/eval.md"))
    ap.add_argument("--reuse", action="store_true", help="use an existing OUT/<scale>/bench_eval.json, do not re-run")
    a = ap.parse_args()
    sections = []
    for scale in a.scales.split(","):
        n_eps, m = (int(x) for x in scale.lower().split("x"))
        tasks = max(1, min(n_eps // 2, 10))
        trials = n_eps // tasks
        out = Path(a.out) / f"{n_eps}ep_{m}env"
        cmd = [sys.executable, "-m", "wamkit.cli.main", "bench", "eval", "env=libero", f"suite={a.suite}",
               f"tasks={','.join(str(t) for t in range(tasks))}", f"trials={trials}", f"max_steps={a.max_steps}",
               f"num_envs={m}", "policy=fixed-cost", f"policy_args.base_ms={a.base_ms}",
               f"policy_args.per_obs_ms={a.per_obs_ms}", f"image_size={a.image_size}", f"out={out}"]
        print(" ".join(cmd[2:]), flush=True)
        if not (a.reuse and (out / "bench_eval.json").exists()):
            subprocess.run(cmd, check=True, cwd=ROOT)
        md = (out / "bench_eval.md").read_text()
        sections.append(f"### {tasks * trials} episodes, {m} envs ({a.suite}, {tasks} tasks x {trials} init states, "
                        f"max_steps {a.max_steps})\n\ncommand: `wamkit {' '.join(cmd[3:])}`\n\n{md}")
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    head = (f"## LIBERO scheduler table ({now})\n\nmachine: {os.cpu_count()} cores ({cpu_model()}), "
            f"{platform.python_version()}, MuJoCo EGL on llvmpipe; policy fixed-cost base_ms={a.base_ms} "
            f"per_obs_ms={a.per_obs_ms} (slept, GPU-like); image {a.image_size}px, 2 cameras.\n"
            f"script: `.venv/bin/python bench/bench_eval.py --scales {a.scales} --max-steps {a.max_steps}`\n\n")
    text = head + "\n".join(sections)
    p = Path(a.results)
    p.parent.mkdir(parents=True, exist_ok=True)
    old = p.read_text() if p.exists() else "# Evaluation scheduler benchmarks (bench/bench_eval.py)\n\n"
    p.write_text(old + "\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
