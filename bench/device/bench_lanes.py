"""Do two batches at once pay on this GPU? wam-ref predict from 1..N lanes (the server's concurrent_batches),
without HTTP or simulators.

    python3 bench/device/bench_lanes.py --out $OUT/lanes.json [--size small] [--batches 1,8,16] [--lanes 1,2,3]
        [--seconds 4] [--compile] [--steps 10]
    python3 bench/device/bench_lanes.py --out /tmp/l.json --device cpu --size tiny --batches 1,2 --lanes 1,2 \
        --seconds 0.5    # CPU smoke run

Each lane is the policy or one of its replicas (`Policy.replica()`: its own engine, CUDA graphs and stream, the
weights shared), warmed up (graphs captured) before any timing, and driven by its own thread in a closed loop: one
predict of `batch` observations after another for `seconds`. Per (lanes, batch): calls and observations per second
over all lanes, the median call, and the speed-up over one lane at that batch. The eval's wam-ref small
(bench/device/eval_metaworld.yaml: one 224 px camera, state 39, 4 actions, 10 steps) is the default: a model that
takes about as long for 1 observation as for 16, so one batch leaves the GPU mostly idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from wamkit.policies import make_policy  # noqa: E402


def drive(lanes: list, batch: int, seconds: float) -> dict:
    """Every lane in its own thread, predicting `batch` observations back to back until `seconds` have passed."""
    calls: list[list[float]] = [[] for _ in lanes]
    obs = [p.synthetic_observations(batch, np.random.default_rng(i)) for i, p in enumerate(lanes)]
    start = threading.Barrier(len(lanes) + 1)
    stop_at = [0.0]

    def run(i: int) -> None:
        start.wait()
        while time.perf_counter() < stop_at[0]:
            t0 = time.perf_counter()
            lanes[i].predict(obs[i], list(range(batch)))
            calls[i].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lanes))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    start.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    every = [c for lane in calls for c in lane]
    return {"lanes": len(lanes), "batch": batch, "calls": len(every), "wall_s": round(wall, 3),
            "calls_per_s": round(len(every) / wall, 2), "obs_per_s": round(batch * len(every) / wall, 2),
            "p50_ms": round(1000 * statistics.median(every), 3) if every else None,
            "calls_per_lane": [len(c) for c in calls]}


def lane_policy_args(a: argparse.Namespace, batches: list[int]) -> dict:
    """The eval rows' policy (bench/device/eval_metaworld.yaml's policy_args: CUDA graphs on, one camera, ...) with
    this run's size, device, steps, buckets and compile. Session 15 built its own list without cuda_graphs, so its
    lanes ran eager (90 ms a call at batch 1 against the eval server's 14 ms) and measured nothing the eval uses."""
    import yaml

    kw = dict(yaml.safe_load((Path(__file__).parent / "eval_metaworld.yaml").read_text())["policy_args"])
    kw.update(size=a.size, device=a.device, dtype=a.dtype if a.device != "cpu" else "float32",
              num_inference_steps=a.steps, max_batch_size=max(batches),
              graph_buckets=",".join(str(b) for b in batches), compile=a.compile)
    return kw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--lanes", default="1,2,3")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="policy_args.compile=true (as session 14's eval rows)")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    lane_counts = sorted({int(n) for n in a.lanes.split(",")})
    kw = lane_policy_args(a, batches)
    t0 = time.perf_counter()
    pol = make_policy("wam-ref", **kw)
    lanes = [pol] + [pol.replica() for _ in range(max(lane_counts) - 1)]
    warm = [lane.warmup(max(batches)) for lane in lanes]
    print(f"built and warmed {len(lanes)} lane(s) in {time.perf_counter() - t0:.1f} s: {warm}", flush=True)
    rows = []
    for b in batches:
        base = None
        for n in lane_counts:
            r = drive(lanes[:n], b, a.seconds)
            base = base or r["obs_per_s"]
            r["speedup"] = round(r["obs_per_s"] / base, 3) if base else None
            rows.append(r)
            print(f"batch {b:3d} lanes {n}: {r['obs_per_s']:8.1f} obs/s {r['calls_per_s']:7.1f} calls/s "
                  f"p50 {r['p50_ms']} ms  x{r['speedup']} of one lane  per lane {r['calls_per_lane']}", flush=True)
    info = {"args": vars(a), "policy_args": kw, "rows": rows, "warmup_s": warm}
    try:
        import torch

        if a.device == "cuda":
            info["device_name"] = torch.cuda.get_device_name(0)
        info["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - the figures stand without it
        pass
    Path(a.out).write_text(json.dumps(info, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
