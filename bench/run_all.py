"""`make bench`: every CPU benchmark of bench/, one after another (they share the CPU: never in parallel), then
docs/benchmarks-history.md (every dated run, the lab notebook) is rebuilt from bench/results/*.md. The current
figures, one table per claim, are docs/benchmarks.md (written by hand from these). GPU measurements: bench/device/run_all.sh on the device.

    .venv/bin/python bench/run_all.py [--only eval,serve] [--docs-only]"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {  # name -> (script, args)
    "envs": ("bench_env_chunk.py", []),
    "serve": ("bench_serve.py", []),
    "ws": ("bench_ws.py", []),
    "data": ("bench_data.py", []),
    "policy": ("bench_policy.py", []),
    "train": ("bench_train.py", []),
    "ray": ("bench_ray.py", []),
    "eval": ("bench_eval.py", []),
}
ORDER = ["cosmos3", "eval", "loop", "envs", "serve", "ws", "data", "policy", "train", "ray", "gpu"]
TITLES = {"cosmos3": "The reference flow on LIBERO, CPU (Cosmos3 path, SGLang stand-in)", "eval": "Evaluation scheduler (issue: pipelined evaluation)", "loop": "Learning loop (make demo)", "envs": "Environments",
          "serve": "Action serving", "ws": "Websocket vs HTTP serving (openpi, SGLang realtime)",
          "data": "Data loading", "policy": "Models (CPU inference)", "train": "Training (CPU)", "ray": "Ray runtime",
          "gpu": "GPU measurements (H200, device)"}


def build_docs() -> Path:
    parts = ["# Benchmarks: every run (history)\n",
             "The current figures, one table per claim, are in [benchmarks.md](benchmarks.md); this page keeps every "
             "dated run, including superseded ones and their corrections.\n",
             "Every figure below comes from a script in `bench/` (its command is given with it), on the machine and at "
             "the date stated. Timings are whole-run wall-clock figures, never test thresholds. The CPU figures were "
             "taken on the 2-core development machine; where other work shared the CPU at the time, the section says "
             "so. Rebuild this page with `.venv/bin/python bench/run_all.py --docs-only`.\n"]
    res = ROOT / "bench" / "results"
    for name in ORDER:
        p = res / f"{name}.md"
        if not p.exists():
            continue
        body = p.read_text().strip()
        # demote the results file's own headings one level under this page's section
        body = "\n".join(("#" + line) if line.startswith("#") else line for line in body.splitlines())
        parts.append(f"## {TITLES[name]}\n\nSource: `bench/results/{name}.md`\n\n{body}\n")
    out = ROOT / "docs" / "benchmarks-history.md"
    out.write_text("\n".join(parts))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--docs-only", action="store_true")
    a = ap.parse_args()
    if not a.docs_only:
        names = [n for n in SCRIPTS if not a.only or n in a.only.split(",")]
        for n in names:
            script, args = SCRIPTS[n]
            print(f"== bench {n}: {script}", flush=True)
            r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT)
            if r.returncode != 0:
                print(f"bench {n} failed with exit code {r.returncode}", file=sys.stderr)
    print(f"wrote {build_docs()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
