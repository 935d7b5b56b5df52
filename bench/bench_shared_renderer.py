"""What one frame costs an env with renderer=shared against its own renderer (MetaWorld, one env, warm).

    .venv/bin/python bench/bench_shared_renderer.py [--size 224] [--frames 200] [--quality fast] [--json out.json]

Per renderer: milliseconds per frame of `env._render` (the env's side: its own mujoco.Renderer, or the request to the
render process and the wait for its pixels), after a warm-up that loads the model (and, shared, registers its MJB).
Also the request's size in bytes. On a CPU machine both renderers are Mesa llvmpipe, so the difference is the
round trip (serialising the kinematics, the socket, the copy of the pixels); on the GPU machine the point is another
one, the GL contexts beside the model (docs/benchmarks.md 3), which this single-env figure does not show.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _common import cpu_model, write_cases_json  # noqa: E402


def frame_ms(renderer: str, size: int, frames: int, quality: str) -> dict:
    import numpy as np

    from wamkit.envs import render_wire as wire
    from wamkit.envs.metaworld import MetaWorldEnv

    env = MetaWorldEnv(tasks=("pick-place-v3",), image_size=size, render_quality=quality, renderer=renderer,
                       max_steps=frames + 10)
    try:
        env.reset(0, 0)
        env.execute(np.zeros((3, 4), np.float32))    # warm: the model loaded, a frame drawn
        times = []
        for _ in range(frames):
            t = time.perf_counter()
            env._render("image")
            times.append((time.perf_counter() - t) * 1e3)
        row = {"renderer": renderer, "size": size, "frames": frames, "ms_p50": round(statistics.median(times), 3),
               "ms_mean": round(statistics.fmean(times), 3)}
        if env._client is not None:
            e = env._envs[0]
            row["request_bytes"] = len(wire.pack_arrays(wire.frame_sources(e.model, e.data))[1])
        return row
    finally:
        env.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--quality", default="fast")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = [frame_ms(r, a.size, a.frames, a.quality) for r in ("own", "shared")]
    for r in rows:
        extra = f", request {r['request_bytes']} B" if "request_bytes" in r else ""
        print(f"{r['renderer']:>6}: {r['ms_p50']:.2f} ms/frame p50, {r['ms_mean']:.2f} mean ({r['frames']} frames "
              f"at {r['size']}px{extra})")
    print(f"shared / own (p50): {rows[1]['ms_p50'] / rows[0]['ms_p50']:.3f}")
    write_cases_json(a.json, {"cpu": cpu_model(), "quality": a.quality}, rows)


if __name__ == "__main__":
    main()
