"""wam-ref's input preprocessing on the CPU: `prepare_inputs` (tokens, positions, uint8 images -> patches) per batch.

    .venv/bin/python bench/bench_prepare.py                    # batches 1,16,64, 15 calls each -> stdout
    .venv/bin/python bench/bench_prepare.py --batches 64 --repeats 30 --json /tmp/prep.json

Each batch: distinct random 256x256 images for both cameras (nano-shape's image_size), LIBERO-like task strings, a
tiny model with image_size 256 and 128 text tokens (preprocessing does not depend on the model's width); median and
max of `repeats` calls after one warm-up. On a GPU the same code runs its float work on the device; bench_nano.py
times it there ("prep" beside each row). To A/B two versions of src/, run this file with PYTHONPATH pointing at each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_policy import observations  # noqa: E402

from wamkit.policies import make_policy  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    pol = make_policy("wam-ref", size="tiny", image_size=256, max_text_len=128)
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        obs = observations(b, seed=b)
        images, tasks = [o.images for o in obs], [o.task for o in obs]
        pol.prepare_inputs(images, tasks)   # warm-up
        took = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            pol.prepare_inputs(images, tasks)
            took.append((time.perf_counter() - t0) * 1e3)
        rows.append({"batch": b, "median_ms": statistics.median(took), "max_ms": max(took),
                     "min_ms": min(took), "repeats": a.repeats})
        print(f"batch {b:3d}: prepare_inputs median {rows[-1]['median_ms']:7.1f} ms (min {min(took):.1f}, "
              f"max {max(took):.1f}) over {a.repeats} calls", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
