"""Why is the action server slower during an evaluation than alone? One server, one client, controlled background load.

    python bench/device/bench_contention.py --out $OUT/contention.json [--seconds 6] [--threads 4,16]
        [--scenarios base,gap,cpu15,sim8,sim15,sim15render,sim14pinned] [--batches 1,4]

The server is `wamkit serve` with the policy of bench/device/eval_metaworld.yaml (wam-ref small, bf16, CUDA graphs).
One client sends requests of B observations one after the other (as an env group waiting on its chunk does) for
`seconds`, and records the round trip and the server's own compute time per request (the response's timing). The
scenarios change only what runs beside it:
- base: nothing; gap: 150 ms pause between requests (GPU and CPU idle in between, as in the single-batch row);
- cpuK: K processes spinning in pure Python (CPU contention only, no GPU);
- simK: K MetaWorld envs stepping 16-step chunks with random actions, rendering (EGL, same GPU) once per chunk, as
  env workers do in an evaluation; simKrender renders every step (the single-batch row's load);
- simKpinned: simK with the loads on cores 2.. and every server thread on cores 0-1;
- simKnorender: physics only, no GL context; simKidle: the GL context exists (one render at reset), physics only;
- simKshared: simKnorender plus ONE process that renders the same frames (one per chunk the K envs finish) in its
  single GL context, back to back: the same rendering work as simK from 1 GL context instead of K. Where simKshared
  runs the server near simKnorender and simK does not, the GPU's cost of rendering beside the model is the K
  contexts' switching, not the frames, and one process rendering for every env would take most of it back.
- simKsvc: simK with env_args.renderer=shared: the K envs' frames drawn by one render process of wamkit's
  (envs/render_service.py), each env waiting for its frame, as in an evaluation with that setting.
--split also times the same policy in this process, eager prefix and CUDA-graph denoising loop apart, under each load.
GPU SM clock and utilization are sampled (nvidia-smi, 100 ms) during each measurement. Writes one JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from wamkit.core.types import Observation  # noqa: E402

RENDER_QUALITY = "model"   # --render-quality: the MetaWorld loads' render_quality
POLICY_ARGS = {"size": "small", "device": "cuda", "dtype": "bfloat16", "cameras": "image", "state_dim": 39,
               "action_dim": 4, "num_inference_steps": 10, "cuda_graphs": "true"}


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------------- loads
def _load_main(kind: str, index: int, cores: list[int] | None, stop, counter, quality: str = "model",
               renderer: str = "own") -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    if kind == "renderer":   # simKshared's one GL context: a frame for every 16 steps the physics loads made
        from wamkit.envs.base import make_env

        env = make_env("metaworld", image_size=224, max_steps=100, cameras=("image",), render_quality=quality)
        env.reset(0, 0)
        done = 0
        while not stop.is_set():
            due = counter.value // 16 - done
            if due <= 0:
                time.sleep(0.0005)
                continue
            for _ in range(due):
                env._render("image")
            done += due
        env.close()
        return
    if kind == "cpu":
        n = 0
        while not stop.is_set():
            for _ in range(100000):
                n += 1
        return
    from wamkit.envs.base import make_env

    env = make_env("metaworld", image_size=224, max_steps=100,
                   cameras=() if kind in ("simnorender", "simshared") else ("image",),
                   render_quality=quality, renderer=renderer)
    rng = np.random.default_rng(index)
    render = kind == "simrender"
    env.reset(index % 4, index % 50)
    if kind == "simidle":   # the GL context exists (one render at reset), then physics only
        env.cameras = ()
    while not stop.is_set():
        r = env.execute(rng.uniform(-1, 1, (16, 4)).astype(np.float32), render_every_step=render)
        with counter.get_lock():
            counter.value += r.steps
        if r.done:
            env.reset(index % 4, (index + 1) % 50)
    env.close()


class Loads:
    def __init__(self, kind: str, n: int, cores: list[int] | None, quality: str = "model"):
        ctx = mp.get_context("spawn")
        self.stop, self.counter = ctx.Event(), ctx.Value("l", 0)
        kinds = [kind] * n + (["renderer"] if kind == "simshared" else [])
        self.service, renderer = None, "own"
        if kind == "simsvc":   # one render process of wamkit's for every load (renderer=shared)
            from wamkit.envs.render_service import ADDRESS_PREFIX, RenderService, current_gl

            self.service = RenderService(current_gl(), 1)
            renderer = ADDRESS_PREFIX + self.service.address(0)
        self.procs = [ctx.Process(target=_load_main, args=(k, i, cores, self.stop, self.counter, quality, renderer),
                                  daemon=True) for i, k in enumerate(kinds)]
        for p in self.procs:
            p.start()

    def steps(self) -> int:
        return int(self.counter.value)

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        if self.service is not None:
            self.service.close()


class GpuSampler:
    """nvidia-smi every 100 ms in the background; summary() gives the mean SM clock and utilization since mark()."""

    def __init__(self):
        self.rows: list[tuple[float, float, float]] = []
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,utilization.gpu",
                                          "--format=csv,noheader,nounits", "-lms", "100"],
                                         stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        except OSError:
            self.proc = None
        self.t0 = time.time()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                clk, util = (float(x) for x in line.strip().split(","))
                self.rows.append((time.time(), clk, util))
            except ValueError:
                pass

    def mark(self) -> None:
        self.t0 = time.time()

    def summary(self) -> dict:
        r = [x for x in self.rows if x[0] >= self.t0]
        if not r:
            return {}
        return {"sm_clock_mhz": round(statistics.mean(x[1] for x in r)),
                "gpu_util": round(statistics.mean(x[2] for x in r))}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


# ---------------------------------------------------------------------------------------------------- client
def observations(b: int) -> list[Observation]:
    """b MetaWorld-shaped observations (one 224x224 camera, 39-D state), seeded by b."""
    rng = np.random.default_rng(b)
    return [Observation({"image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)},
                        rng.standard_normal(39).astype(np.float32), "pick place") for _ in range(b)]


async def measure(url: str, b: int, seconds: float, gap_s: float) -> dict:
    from wamkit.serve import ActionClient

    obs = observations(b)
    req, comp = [], []
    async with ActionClient(url) as c:
        for _ in range(3):
            await c.predict(obs, list(range(b)))
        t_end = time.perf_counter() + seconds
        k = 0
        while time.perf_counter() < t_end:
            await c.predict(obs, [k * b + i for i in range(b)])
            t = c.last_timings[0]
            req.append(t["client_ms"])
            comp.append((t["server"] or {}).get("compute_ms", float("nan")))
            k += 1
            if gap_s:
                await asyncio.sleep(gap_s)
    return {"batch": b, "requests": len(req), "request_ms": round(statistics.median(req), 1),
            "compute_ms": round(statistics.median(comp), 1), "compute_p90_ms": round(float(np.percentile(comp, 90)), 1),
            "obs_s_busy": round(b * 1000.0 / statistics.median(req), 1)}


def split_times(pol, b: int, seconds: float) -> dict:
    """Wall ms of the eager prefix (vision + understanding tower) and of the graph-replayed loop, one call at a time."""
    import torch

    obs = observations(b)
    pre, loop = [], []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(pre) < 3:
        inputs = pol.prepare_inputs([o.images for o in obs], [o.task for o in obs], [o.state for o in obs])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefix = pol.model.encode_prefix(inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"],
                                         inputs["pixel_values"], inputs["image_grid_thw"], inputs["position_ids"])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        x = pol.noise(list(range(b))).to(pol.device)
        pol.engine.sample_graphed(prefix, x, inputs["state"], pol.num_inference_steps)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        pre.append((t1 - t0) * 1e3)
        loop.append((t2 - t1) * 1e3)
    return {"split_prefix_ms": round(statistics.median(pre), 1), "split_loop_ms": round(statistics.median(loop), 1)}


def pin_process(pid: int, cores: list[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass


def run_server(threads: int, scenarios: list[str], batches: list[int], seconds: float, gpu: GpuSampler,
               pol=None) -> list:
    from wamkit.serve import WamkitServerWorker

    out = []
    w = WamkitServerWorker("wam-ref", POLICY_ARGS, max_batch_size=64, max_wait_ms=2.0,
                           extra_args={"torch_threads": threads})
    w.start()
    try:
        t0 = time.perf_counter()
        w.wait_healthy(timeout=600)
        log(f"server torch_threads={threads} healthy after {time.perf_counter() - t0:.1f} s")
        ncores = os.cpu_count() or 16
        for sc in scenarios:
            kind, n, cores, gap = "none", 0, None, 0.0
            if sc == "gap":
                gap = 0.15
            elif sc.startswith("cpu"):
                kind, n = "cpu", int(sc[3:])
            elif sc.startswith("sim"):
                rest = sc[3:]
                kind = "sim"
                for suffix in ("norender", "render", "idle", "shared", "svc"):
                    if rest.endswith(suffix):
                        kind, rest = "sim" + suffix, rest[: -len(suffix)]
                pinned = rest.endswith("pinned")
                n = int(rest.replace("pinned", ""))
                if pinned:
                    cores = list(range(2, ncores))
                    pin_process(w.pid, [0, 1])
            loads = Loads(kind, n, cores, RENDER_QUALITY) if n else None
            try:
                if loads is not None:
                    time.sleep(8.0 if kind != "cpu" else 1.0)   # env construction
                for b in batches:
                    s0, t0 = loads.steps() if loads else 0, time.perf_counter()
                    gpu.mark()
                    r = asyncio.run(measure(w.url, b, seconds, gap))
                    r.update(gpu.summary())
                    if pol is not None:
                        r.update(split_times(pol, b, min(seconds, 4.0)))
                    r.update({"scenario": sc, "torch_threads": threads,
                              "load_steps_s": round(((loads.steps() if loads else 0) - s0)
                                                    / (time.perf_counter() - t0), 1)})
                    log(json.dumps(r))
                    out.append(r)
            finally:
                if loads is not None:
                    loads.close()
                if sc.endswith("pinned"):
                    pin_process(w.pid, list(range(ncores)))
    finally:
        w.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--threads", default="4,16")
    ap.add_argument("--scenarios", default="base,gap,cpu15,sim8,sim15,sim15render,sim14pinned")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--threads16-scenarios", default="base,sim15")
    ap.add_argument("--split", action="store_true", help="also time prefix and loop apart in this process")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: wam-ref tiny on the CPU")
    ap.add_argument("--render-quality", default="model", help="render_quality of the MetaWorld loads (model|fast)")
    args = ap.parse_args(argv)
    global RENDER_QUALITY
    RENDER_QUALITY = args.render_quality
    res_gl = {"MUJOCO_GL": os.environ.get("MUJOCO_GL"), "render_quality": RENDER_QUALITY}
    if args.smoke:
        POLICY_ARGS.update(size="tiny", device="cpu", dtype="float32", cuda_graphs="false")
    os.environ.setdefault("MUJOCO_GL", "egl")
    gpu = GpuSampler()
    res = {"rows": [], "policy_args": POLICY_ARGS, "cores": os.cpu_count(), **res_gl}
    batches = [int(x) for x in args.batches.split(",")]
    pol = None
    if args.split:
        from wamkit.policies import make_policy

        pol = make_policy("wam-ref", **POLICY_ARGS)
        pol.warmup(8)
    try:
        for th in [int(x) for x in args.threads.split(",")]:
            scen = args.scenarios.split(",") if th == int(args.threads.split(",")[0]) \
                else args.threads16_scenarios.split(",")
            res["rows"] += run_server(th, scen, batches, args.seconds, gpu, pol)
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        gpu.close()
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
