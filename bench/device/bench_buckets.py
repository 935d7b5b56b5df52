"""What a batch costs the evaluation's server model at every size, and what CUDA-graph buckets add by padding.

    python bench/device/bench_buckets.py --out $OUT/buckets.json [--max-batch 32] [--reps 15] [--compile 1]

The model is the one `wamkit bench eval` serves on MetaWorld (bench/device/eval_metaworld.yaml: wam-ref small, bf16,
CUDA graphs, 10 steps, one 224x224 camera, compile as --compile), built with a graph bucket at every batch size
1..max-batch, so each size runs its own graph (no padding). For every size n: the median `predict` time of n
observations over --reps calls, and the capture time of its bucket (warm-up, compile included for the first two).
Then, from the same figures, what each size would cost with the default buckets (config.graph_buckets: 1, 2, 4, 8,
16, 24, 32, ...; a batch runs the graph of the next bucket up, padded): the ratio is the padding's cost for a batch of
that size, which the server meets whenever requests merge into a batch that is not a bucket (the greedy and plan
shapes of `mode=auto`, `B=1, P=n` rows). Writes one JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from wamkit.policies import make_policy  # noqa: E402
from wamkit.policies.wam_ref.config import bucket_for, graph_buckets  # noqa: E402

POLICY_ARGS = {"size": "small", "device": "cuda", "dtype": "bfloat16", "cameras": ["image"], "state_dim": 39,
               "action_dim": 4, "num_inference_steps": 10, "cuda_graphs": True, "horizon": 16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--compile", type=int, default=1)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no graphs, sizes tiny)")
    a = ap.parse_args()
    import torch

    args = dict(POLICY_ARGS)
    if a.device != "cuda":
        args.update(device=a.device, size="tiny", cuda_graphs=False, dtype="float32")
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    top = a.max_batch
    every = ",".join(str(b) for b in range(1, top + 1))
    t0 = time.perf_counter()
    pol = make_policy("wam-ref", **args, compile=bool(a.compile), max_batch_size=top, graph_buckets=every)
    build_s = time.perf_counter() - t0
    warm = pol.warmup(top)
    print(f"built in {build_s:.1f} s; warm-up (capture per bucket): "
          + ", ".join(f"{k}:{v:.2f}" for k, v in warm.items()), flush=True)
    rng = np.random.default_rng(1)
    ms = {}
    for n in range(1, top + 1):
        obs = pol.synthetic_observations(n, rng)
        times = []
        for r in range(a.reps + 1):
            sync()
            t = time.perf_counter()
            pol.predict(obs, list(range(n)))
            sync()
            if r:
                times.append((time.perf_counter() - t) * 1000.0)
        ms[n] = statistics.median(times)
    default = graph_buckets(None, top)
    rows = []
    for n in range(1, top + 1):
        b = bucket_for(default, n)
        rows.append({"n": n, "ms": round(ms[n], 3), "obs_per_s": round(n / ms[n] * 1000.0, 1),
                     "default_bucket": b, "ms_default_bucket": round(ms[b], 3),
                     "padding_cost": round(ms[b] / ms[n], 3)})
    print(f"{'n':>3} {'ms':>8} {'obs/s':>8} {'bucket':>6} {'ms@bucket':>9} {'x':>6}")
    for r in rows:
        print(f"{r['n']:>3} {r['ms']:>8.2f} {r['obs_per_s']:>8.1f} {r['default_bucket']:>6} "
              f"{r['ms_default_bucket']:>9.2f} {r['padding_cost']:>6.3f}")
    name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    out = {"device": name, "torch": torch.__version__, "policy_args": args,
           "compile": bool(a.compile), "reps": a.reps, "build_s": round(build_s, 1),
           "warmup_s": {k: round(v, 3) for k, v in warm.items()}, "default_buckets": list(default), "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
