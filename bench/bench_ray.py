"""runtime=local vs runtime=ray on this machine, and what moving one observation through Ray costs.

    .venv/bin/python bench/bench_ray.py [--n 200] [--out bench/results/ray.md]

1. The same small evaluation (MetaWorld, metaworld-expert, 2 tasks x 2 trials, horizon 4, max 80 steps, mode=auto,
   2 envs) with runtime=local (spawned EnvWorker processes, shared memory) and runtime=ray (a private local Ray started
   for the run: env actors in a placement group). Wall time of the scheduler (envs already up) and end to end
   (including worker start; for Ray also ray.init and the shutdown).
2. Per-observation transfer: an observation of 2 cameras 256x256x3 uint8 + a 39-D float32 state (~384 KiB).
   - Ray probe: an actor call that returns a fresh observation (no simulation), awaited from asyncio; copy_obs on
     (arrays copied out of the object store, the default) and off (zero-copy read-only views); and an echo call that
     sends one and gets it back.
   - Same env step both ways: `execute` of a 1-step chunk on a MetaWorld env rendering those 2 cameras at 256x256, in
     this process (no transport), through the local EnvWorker (pipe + shared memory) and through a Ray env actor.
     The transport cost is the difference to the in-process time.
Medians over --n calls. The CPU is shared with other work: absolute numbers move with the load; compare rows measured
in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from _common import cpu_model  # noqa: E402  (bench/ is on sys.path when run as a script)
EVAL_ARGS = ["env=metaworld", "suite=mt", "tasks=3,4", "trials=2", "policy=metaworld-expert", "horizon=4",
             "max_steps=80", "image_size=64", "mode=auto", "num_envs=2", "progress=false", "seed=3"]
RAY_ARGS = ["runtime=ray", "ray.num_cpus_per_env=1", "ray.memory_gb_per_env=0.5", "ray.num_cpus=2"]
ENV_KW = {"suite": "mt", "image_size": 256, "cameras": ("image", "wrist_image"), "max_steps": 100000, "seed": 0}


def _eval(out: Path, extra: list[str]) -> tuple[float, float, list]:
    import json

    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.runner import run_eval
    from wamkit.runtime import eval_runtime

    cfg = load_config(EvalConfig, None, [*EVAL_ARGS, f"out={out}", *extra])
    cfg.validate()
    t0 = time.perf_counter()
    s = run_eval(cfg, **eval_runtime(cfg))
    total = time.perf_counter() - t0
    recs = sorted((json.loads(x) for x in (out / "results.jsonl").read_text().splitlines() if x),
                  key=lambda r: r["key"])
    return s["throughput"]["wall_s"], total, [(r["key"], r["success"], r["steps"]) for r in recs]


def _med_ms(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.2f}"


def _p90_ms(ts: list[float]) -> str:
    return f"{sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e3:.2f}"


async def _time_async(fn, n: int) -> list[float]:
    for _ in range(3):
        await fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        ts.append(time.perf_counter() - t0)
    return ts


def _time_sync(fn, n: int) -> list[float]:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="calls per transfer-probe row")
    ap.add_argument("--n-exec", type=int, default=20, help="calls per env-step row (each renders 2 cameras)")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench/results/ray.md"))
    args = ap.parse_args()
    rows_eval, rows_tx = [], []
    zero = np.zeros((1, 4), np.float32)

    same = None
    if not args.skip_eval:   # ---- 1. the same evaluation, both runtimes
        with tempfile.TemporaryDirectory() as d:
            w_l, t_l, r_l = _eval(Path(d) / "local", ["runtime=local"])
            w_r, t_r, r_r = _eval(Path(d) / "ray", RAY_ARGS)
        same = r_l == r_r
        rows_eval.append(("local (EnvWorker processes)", w_l, t_l))
        rows_eval.append(("ray (private local Ray, 2 env actors)", w_r, t_r))
        print(f"eval local {w_l:.1f}/{t_l:.1f} s, ray {w_r:.1f}/{t_r:.1f} s, identical per-episode results: {same}",
              flush=True)

    # ---- 2. transfer
    from wamkit.envs import make_env
    from wamkit.envs.worker import EnvWorker
    from wamkit.runtime import ray_session
    from wamkit.runtime.ray_runtime import make_ray_env_workers

    env = make_env("metaworld", **ENV_KW)
    env.reset(3, 0)
    nbytes = env.execute(zero).obs.nbytes()
    rows_tx.append(("env.execute(1 step) in this process (no transport)", _time_sync(lambda: env.execute(zero),
                                                                                     args.n_exec)))
    env.close()
    print("inprocess done", flush=True)
    with EnvWorker("metaworld", ENV_KW, index=0) as lw:
        lw.reset_sync(3, 0)

        async def local_exec():
            return await lw.execute(zero)

        rows_tx.append(("local EnvWorker: await execute(1 step)", asyncio.run(_time_async(local_exec, args.n_exec))))
    print("local done", flush=True)

    sess = ray_session.acquire({"num_cpus": 2})
    try:
        for copy in (True, False):
            ws = make_ray_env_workers("metaworld", ENV_KW, 1, {"memory_gb_per_env": 0.5, "copy_obs": copy})
            w = ws[0].start()
            try:
                w.reset_sync(3, 0)

                async def ray_exec(w=w):
                    return await w.execute(zero)

                async def probe(w=w):
                    o = await w.actor.make_obs.remote(2, 256, 39)
                    return w._fix_obs(o)

                async def run_all(w=w, copy=copy):
                    out = [(f"Ray env actor (copy_obs={copy}): await execute(1 step)",
                            await _time_async(ray_exec, args.n_exec)),
                           (f"Ray probe (copy_obs={copy}): await actor call returning the observation",
                            await _time_async(probe, args.n))]
                    if copy:
                        obs = await w.actor.make_obs.remote(2, 256, 39)

                        async def echo():
                            return await w.actor.echo.remote(obs)

                        out.append(("Ray probe: echo (observation sent and returned)", await _time_async(echo, args.n)))
                    return out

                rows_tx.extend(asyncio.run(run_all()))
            finally:
                w.close()
        print("ray done", flush=True)
    finally:
        ray_session.release(sess)

    cpu = cpu_model()
    lines = [
        "# runtime=ray vs runtime=local on one machine",
        "",
        f"Command: `.venv/bin/python bench/bench_ray.py --n {args.n} --n-exec {args.n_exec}`  ",
        f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"ray {__import__('ray').__version__}, no GPU. Date: {datetime.date.today().isoformat()}.  ",
        f"Load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (above ~1.5, other work "
        "shared the CPU: absolute times move with that load; compare rows of the same run).",
        "",
        "## The same evaluation",
        "",
        "MetaWorld, metaworld-expert, tasks 3,4 x 2 trials, horizon 4, max 80 steps, 64x64 camera, mode=auto, "
        "2 envs. Ray: a private local Ray (started and shut down by the run), env actors of 1 CPU in a placement "
        "group.",
        "",
        "| runtime | scheduler wall (s) | end to end (s) | ratio to local (scheduler / end to end) |",
        "|---|---|---|---|",
    ]
    for name, w, t in rows_eval:
        lines.append(f"| {name} | {w:.1f} | {t:.1f} | {w / rows_eval[0][1]:.2f} / {t / rows_eval[0][2]:.2f} |")
    lines += ["", f"Per-episode results identical (key, success, steps): **{same}**.", "",
              "## One observation through each transport", "",
              f"Observation: 2 cameras 256x256x3 uint8 + 39-D float32 state = {nbytes / 1024:.0f} KiB. "
              f"Median and p90 over {args.n} calls ({args.n_exec} for the env-step rows), awaited from asyncio (sync for the in-process row).", "",
              "| path | median (ms) | p90 (ms) |", "|---|---|---|"]
    for name, ts in rows_tx:
        lines.append(f"| {name} | {_med_ms(ts)} | {_p90_ms(ts)} |")
    base = statistics.median(rows_tx[0][1])
    lines += ["", "Transport overhead per observation (median minus the in-process step): "
              + ", ".join(f"{name.split(':')[0]}: {(statistics.median(ts) - base) * 1e3:.2f} ms"
                          for name, ts in rows_tx[1:] if "execute" in name) + ".", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
