"""`wamkit bench eval`: the scheduler table on one episode plan.

Rows (all on the same plan, same policy):
  single-batch   serial, every step rendered, episodes run to max steps (what the reference does with B=1, P=1)
  serial         serial with render skipping, run to max steps
  B=b, P=p       the reference's pipelines with B x P = num_envs, render skipping, run to max steps
  auto           asynchronous flow, render skipping, run to max steps (scheduling alone vs serial)
  auto+          auto with every wamkit feature on (render skipping, episodes end at success)
  ROW @ k=v ...  one of the rows above with per-row settings (ROW_KEYS), e.g. `B=16, P=2 @ server.reserve_cpus=2`:
                 an A/B inside one run, its rounds interleaved with the plain row's
Stage bound: simulation alone (`zero` policy, auto, same envs) and inference alone (batches of the chosen size
back to back), both in env steps/s; bound = min of the two. Loop bound: an env cannot simulate while it waits for
its own actions, so no schedule beats num_envs x horizon / (its fastest chunk + the fastest call): the chunk from the
simulation-alone run (an env per core), the call a lone one-observation request through the same path, measured
before the inference bound's batches (see loop_bound). Ratios are over the single-batch row."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from wamkit.core.config import load_config
from wamkit.core.cpu_pinning import can_lower_nice
from wamkit.core.errors import ConfigError
from wamkit.core.files import write_atomic
from wamkit.eval.config import EvalConfig
from wamkit.eval.deadline import RowDeadline
from wamkit.eval.host_load import cgroup_throttling, cpu_times, shares, throttled
from wamkit.eval.metrics import task_chunk_ms
from wamkit.eval.report import WORKER_MS_KEYS, chunk_text
from wamkit.eval.steady import steady_lines, steady_vs_best_fixed
from wamkit.eval.timeline import batch_sizes_summary

# keys a row may set for itself (`ROW @ key=value ...`): settings that act per run, with the env workers and the
# servers the rows share (a key that changes the plan or what the servers run cannot be per row); the env_args keys
# give the row env workers of their own (KeptEnvs keeps a set per env configuration, warmed like the bench's)
ROW_KEYS = ("server.reserve_cpus", "env_nice", "auto_probe", "auto_shapes", "max_request_size", "env_args.renderer",
            "env_args.render_processes")


def _run(cfg: EvalConfig, console: Console, runtime: dict[str, Any] | None = None) -> dict[str, Any]:
    from wamkit.eval.runner import run_eval

    position_envs(cfg, (runtime or {}).get("env_workers"), console)
    return run_eval(cfg, console=console, **(runtime or {}))


def position_envs(cfg: EvalConfig, envs, console: Console) -> None:
    """Before a timed run on kept env workers: load in each env the task the run's scheduler will give it
    (eval/affinity.assign over the envs' loaded scenes and the plan), so every row starts from the same state
    instead of inheriting the last row's scenes. Not part of any row, like warm_envs; scene loads the schedule
    itself causes (a task's episodes running out) stay in the row and are counted (scene_loads)."""
    from concurrent.futures import ThreadPoolExecutor

    from wamkit.eval.affinity import assign

    workers = list(getattr(envs, "workers", None) or [])[:cfg.num_envs]
    if cfg.mode == "serial" or len(workers) < 2:
        return
    tasks = list(cfg.tasks) if cfg.tasks else list(range(len(workers[0].tasks)))
    if len(workers) < len(tasks):
        return
    loaded = {i: w.loaded_task for i, w in enumerate(workers) if isinstance(w.loaded_task, int)}
    move = [(i, t) for i, t in assign(loaded, {t: cfg.trials for t in tasks}, len(workers)).items()
            if loaded.get(i) != t]
    if not move:
        return
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(move)) as ex:
        list(ex.map(lambda it: workers[it[0]].reset_sync(it[1], 0), move))
    console.print(f"[bold]bench eval[/] {len(move)} env(s) loaded the task they start the row on in "
                  f"{time.perf_counter() - t0:.1f} s (not part of any row)")


def _row(name: str, s: dict[str, Any], horizon: int) -> dict[str, Any]:
    th = s["throughput"]
    sch = s.get("scheduler", {})
    return {"row": name, "episodes": th["episodes_this_run"], "wall_s": th["wall_s"],
            "setup_s": sch.get("setup_s", 0.0),
            "episodes_per_hour": th["episodes_per_hour"], "env_steps_per_s": th["env_steps_per_s"],
            "inference_obs_per_s": th["inference_obs_per_s"], "mean_batch": sch.get("mean_batch", 0.0),
            "env_busy": sch.get("env_busy", 0.0), "inference_busy": sch.get("inference_busy", 0.0),
            "request_ms_mean": sch.get("request_ms_mean", 0.0), "compute_ms_mean": sch.get("compute_ms_mean", 0.0),
            "sim_ms_mean": sch.get("sim_ms_mean", 0.0), "env_wait_ms_mean": sch.get("env_wait_ms_mean", 0.0),
            "sim_worker_ms_mean": sch.get("sim_worker_ms_mean"), "server_batches": sch.get("server_batches") or {},
            "cpu_worker_ms_mean": sch.get("cpu_worker_ms_mean"),
            "render_worker_ms_mean": sch.get("render_worker_ms_mean"),
            "scene_loads": sch.get("scene_loads", 0), "scene_load_s": sch.get("scene_load_s", 0.0),
            "request_retries": sch.get("request_retries", 0),
            "env_steps": th["env_steps"], "success_rate": s["success_rate"],
            "env_render": sch.get("env_render", {}),
            "task_chunk_ms": {tid: ms for tid, row in s.get("per_task", {}).items()
                              if (ms := task_chunk_ms(row)) is not None},
            **({"client": sch["client"]} if sch.get("client") else {}),
            **({"auto_shape": sch["auto_shape"]} if sch.get("auto_shape") else {}),
            **({"progress": sch["progress"]} if sch.get("progress") else {})}


def grid(num_envs: int) -> list[tuple[int, int]]:
    """(B, P) with B x P = num_envs, B descending: the reference's table shape."""
    return [(num_envs // p, p) for p in range(1, num_envs + 1) if num_envs % p == 0]


def bench_policy_kwargs(base: EvalConfig) -> dict[str, Any]:
    """The policy's keyword arguments as run_eval builds them (it reads the action size from a built env's spec;
    here: policy_args.action_dim, else the env class's action_dim, else 7)."""
    from wamkit.envs.base import env_class
    from wamkit.eval.runner import policy_kwargs

    dim = base.policy_args.get("action_dim") or getattr(env_class(base.env), "action_dim", 0) or 7
    return policy_kwargs(base, int(dim))


@contextlib.contextmanager
def shared_servers(base: EvalConfig, console: Console, pinnable: bool = False, log_dir: Path | None = None):
    """inference=server without server.url: start the local server(s) once for every row and the inference bound
    (their start-up and CUDA-graph warm-up happen once, not per row); yields the started workers ([] otherwise),
    stops them at the end. A row restarts one that stops answering, as with its own. pinnable: some row pins them
    (server.reserve_cpus), so they start ready for it (core/cpu_pinning.py)."""
    if base.inference != "server" or base.server.url:
        yield []
        return
    from wamkit.eval.inference import check_normalization, server_policy, start_server_workers
    from wamkit.eval.runner import remote_codec_of

    t0 = time.perf_counter()
    pkw = bench_policy_kwargs(base)
    codec = remote_codec_of(base.policy, pkw)          # cosmos3: the servers run SGLang or its stand-in
    check_normalization(base.server, codec)
    policy, args = server_policy(base.policy, pkw, base.server, codec)
    # capped at the batch the rows and bounds can send (every env's observation at once: num_envs, whatever the
    # base's mode)
    options = dataclasses.replace(base.server, max_batch_size=base.server_batch_cap(base.num_envs))
    workers = start_server_workers(policy, args, options, pinnable=pinnable, log_dir=log_dir)
    try:
        console.print(f"[bold]bench eval[/] {len(workers)} shared server(s) up in {time.perf_counter() - t0:.1f} s")
        yield workers
    finally:
        for w in workers:
            w.stop()


def _slug(row: str) -> str:
    """A row's sub-directory name: 'B=4, P=4' -> 'B4_P4'; 'auto @ server.reserve_cpus=2 env_nice=5' ->
    'auto__server-reserve_cpus2__env_nice5'."""
    name, settings = _row_parts(row)
    return "__".join(p.replace(" ", "").replace(",", "_").replace("=", "").replace(".", "-") for p in [name, *settings])


def _first_task(out: Path, configs) -> str | None:
    """The instruction of the first episode the rows ran (the bound's synthetic observations use it)."""
    for name, _ in configs:
        for p in sorted((out / _slug(name)).glob("**/results.jsonl")):
            for line in p.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    return json.loads(line)["task"]
    return None


def _inference(base: EvalConfig, workers: list | None):
    """The rows' inference path, unstarted: ServerInference over `workers` (servers already running) or a fresh
    in-process policy."""
    from wamkit.eval.inference import InProcessInference, ServerInference
    from wamkit.policies.registry import make_policy

    pkw = bench_policy_kwargs(base)
    if base.inference == "server":
        from wamkit.eval.runner import remote_codec_of

        return ServerInference(policy=base.policy, policy_args=pkw, options=base.server, workers=workers,
                               codec=remote_codec_of(base.policy, pkw), horizon=base.horizon)
    return InProcessInference(make_policy(base.policy, **pkw))


def synthetic_observations(base: EvalConfig, n: int, task: str) -> list:
    """n blank observations in the env's layout as far as the policy args tell it (MetaWorld: 1 camera, 39-D
    state), for the inference-side measurements."""
    import numpy as np

    from wamkit.core.types import Observation
    from wamkit.envs.base import env_class

    pkw = bench_policy_kwargs(base)
    size = base.image_size
    cams = pkw.get("cameras", ("image", "wrist_image"))
    cams = cams.split(",") if isinstance(cams, str) else list(cams)
    state_dim = int(pkw.get("state_dim", 0) or getattr(env_class(base.env), "state_dim", 0) or 8)
    return [Observation({c: np.zeros((size, size, 3), np.uint8) for c in cams},
                        np.zeros(state_dim, np.float32), task) for _ in range(n)]


def inference_bound(base: EvalConfig, batch: int, seconds: float = 5.0, task: str = "bench",
                    workers: list | None = None, stop: threading.Event | None = None) -> float:
    """Observations/s of the inference side alone under back-to-back batches of `batch` (synthetic observations in
    the env's layout; `task`: their instruction, a real one when the policy reads it; `workers`: servers already
    running, for inference=server). stop: run until it is set (at least one round) instead of for `seconds`."""
    return measure_inference(base, batch, seconds, task, workers, stop)[0]


def measure_inference(base: EvalConfig, batch: int, seconds: float = 5.0, task: str = "bench",
                      workers: list | None = None, stop: threading.Event | None = None,
                      lone_calls: int = 0) -> tuple[float, float | None]:
    """(inference_bound's observations/s, the median seconds of `lone_calls` calls of one observation each with
    nothing else in flight, measured first on the same inference path; None when lone_calls is 0)."""
    obs = synthetic_observations(base, batch, task)

    async def go():
        inf = _inference(base, workers)
        await inf.start()
        try:
            await inf.predict(obs, list(range(batch)))   # warm-up
            took = []
            for k in range(lone_calls):
                t0 = time.perf_counter()
                await inf.predict(obs[:1], [k])
                took.append(time.perf_counter() - t0)
            depth = 2 * max(1, len(getattr(inf, "clients", [])))   # two requests in flight per server
            t0 = time.perf_counter()
            n = 0
            while True:
                await asyncio.gather(*(inf.predict(obs, list(range(batch))) for _ in range(depth)))
                n += depth * batch
                if stop.is_set() if stop is not None else time.perf_counter() - t0 >= seconds:
                    break
            return n / (time.perf_counter() - t0), (float(statistics.median(took)) if took else None)
        finally:
            await inf.close()

    return asyncio.run(go())


def bound_batch(base: EvalConfig, num_envs: int) -> int:
    """The batch the inference stage is measured at for the bound: every env's observation at once (capped by the
    request cap), the most the envs can ever ask of it together and, for these models (a fixed cost per call, little
    per observation), its fastest. It was auto's mean request size: once auto sends whatever waits at once
    (eval/shape_probe.py) its requests average ~1 observation while the server merges them into batches of ~8, and
    the H200's lockstep rows (batches of 16) outran the "bound" measured at batch 8 beside the simulators."""
    cap = base.max_request_size or base.server.max_batch_size
    return max(1, min(num_envs, cap))


def loop_bound(num_envs: int, horizon: int, sim_env_steps_per_s: float, cores: int, call_s: float,
               row_chunks_s: Sequence[float] = ()) -> dict[str, Any]:
    """The env-loop bound in env steps/s: each env's cycle is at least its chunk plus one call, so throughput <=
    num_envs x horizon / (chunk_s + call_s). call_s is the fastest call (measure_inference's lone calls). chunk_s is
    the fastest chunk an env was seen to take: the simulation-alone run's (min(num_envs, cores) envs simulating at
    a time: horizon x min(num_envs, cores) / its rate, resets amortized), or a row's mean chunk where one was
    faster (`row_chunks_s`, the timeline's sim_ms_mean). In the simulation-alone run every env simulates at once;
    in a row most of them wait for actions, so the ones simulating share the cores, memory and renderer with fewer
    others: on the H100 (session 15) a row's chunk took 14 ms against the simulation-alone run's 25 ms, and a
    bound built on 25 ms was no ceiling for those rows. Binding where the stage bounds are not: few envs, or calls
    long against chunks."""
    sim_chunk = horizon * min(num_envs, max(1, cores)) / max(sim_env_steps_per_s, 1e-9)
    seen = [c for c in row_chunks_s if c and c > 0]
    chunk_s = min([sim_chunk] + seen)
    return {"chunk_s": chunk_s, "call_s": call_s, "sim_alone_chunk_s": sim_chunk,
            "chunk_from": "rows" if chunk_s < sim_chunk else "simulation alone",
            "bound_env_steps_per_s": num_envs * horizon / max(chunk_s + call_s, 1e-9)}


def _sim_alone(base: EvalConfig, out: Path, common: dict[str, Any], runtime: dict[str, Any] | None) -> EvalConfig:
    """The simulation-alone run of the stage bound: the same envs and plan, the `zero` policy in process. With
    server.reserve_cpus and shared servers, the envs keep the rows' CPUs (and the servers theirs); without shared
    servers there is nothing to reserve for."""
    reserve = base.server.reserve_cpus if (runtime or {}).get("server_workers") else 0
    return dataclasses.replace(base, out=str(out), mode="auto", policy="zero", policy_args={}, inference="inprocess",
                               server=dataclasses.replace(base.server, reserve_cpus=reserve),
                               run_to_max_steps=True, render_every_step=False, **common)


def contended_bound(base: EvalConfig, out: Path, console: Console, runtime: dict[str, Any] | None, batch: int,
                    horizon: int, task: str, common: dict[str, Any]) -> dict[str, Any]:
    """Both stages at once: the simulation-alone run while the inference side serves back-to-back batches of
    `batch` (the same envs and plan; the same servers). When simulation and inference share a machine (rendering on
    the model's GPU, the server's CPU threads beside the env processes), each is slower than alone: this bound is
    what both can do together, the honest ceiling for a row."""
    stop = threading.Event()
    got: dict[str, float] = {}

    def load() -> None:
        got["inf"] = inference_bound(base, batch, task=task, workers=(runtime or {}).get("server_workers"), stop=stop)

    th = threading.Thread(target=load, name="bench-inference-load", daemon=True)
    th.start()
    try:
        sim = _run(_sim_alone(base, out / "bound_sim_contended", common, runtime), console, runtime)
    finally:
        stop.set()
        th.join()
    sim_steps = sim["throughput"]["env_steps_per_s"]
    inf = got.get("inf", 0.0)
    return {"sim_env_steps_per_s": sim_steps, "inference_obs_per_s": inf, "inference_batch": batch,
            "bound_env_steps_per_s": min(sim_steps, inf * horizon)}


def bench_eval(base: EvalConfig, out: Path, console: Console | None = None, rows: list[str] | None = None,
               horizon: int = 16, runtime: dict[str, Any] | None = None, share_server: bool = True,
               rounds: int = 1, bound: bool | str = True, deadline_s: float | None = None) -> dict[str, Any]:
    """runtime: run_eval keyword arguments placing the workers (wamkit.runtime.eval_runtime); None = local.
    share_server: with inference=server (and no server.url, local runtime), one set of local servers serves every
    row and the inference bound; false: each row starts its own (run_eval's default).
    rounds: every row `rounds` times, interleaved (round 1 runs each row once, then round 2 ..., every other round in
    reverse order: round_order), so slow drifts of the machine touch every row alike; a row reports its median env
    steps/s and the min-max spread; the report's `order` lists the rows as each round ran them.
    bound: measure the stage bound after the rows (false: rows only, e.g. a long single-batch row run apart;
    "contended": also both stages at once, see contended_bound).
    deadline_s: seconds from this call on; a row starts only if it and the bound can still finish by then
    (eval/deadline.py), and the report covers the rounds every row finished."""
    from wamkit.eval.runner import check_names

    console = console or Console(stderr=True)
    check_names(base)                      # a misspelled name or option: one line before any row starts
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    if deadline_s is not None and deadline_s <= 0:
        raise ConfigError(f"deadline_s must be > 0 seconds, got {deadline_s}")
    deadline = RowDeadline(deadline_s, bound)   # its clock starts here: env and server start-up count
    if runtime:
        return _bench_eval(base, out, console, rows, horizon, runtime, rounds, with_bound=bound, deadline=deadline)
    # local: one set of env workers for every row (the simulators start once), and shared servers
    from wamkit.eval.kept_envs import KeptEnvs

    check_nice_rows(base, rows)

    envs = KeptEnvs()
    try:
        serial_only = bool(rows) and all(x in ("single-batch", "serial") for x in rows)
        warm_envs(base, envs, console, 1 if serial_only else base.num_envs)
        for cfg in row_env_configs(base, rows):   # rows with env settings of their own: their own envs, warmed too
            warm_envs(cfg, envs, console, base.num_envs)
        out.mkdir(parents=True, exist_ok=True)   # the shared servers log to OUT/server-<i>.log
        shared = (shared_servers(base, console, pins_servers(base, rows), log_dir=out) if share_server
                  else contextlib.nullcontext([]))
        with shared as workers:
            rt: dict[str, Any] = {"env_workers": envs}
            if workers:
                rt["server_workers"] = workers
            return _bench_eval(base, out, console, rows, horizon, rt, rounds, with_bound=bound, deadline=deadline)
    finally:
        envs.close()


def warm_envs(base: EvalConfig, envs, console: Console, n: int) -> None:
    """Start the kept env workers and build one scene in each (env i: task i mod the plan's tasks, trial 0), before
    any row is timed. A process's first scene costs far more than later ones (LIBERO on the H200: ~9 s against
    ~5 s for a new task and ~0.2 s for the next episode of a loaded one), and without this only the first row
    would pay it."""
    from concurrent.futures import ThreadPoolExecutor

    from wamkit.eval.runner import start_env_workers, env_kwargs

    t0 = time.perf_counter()
    workers = envs(base.env, env_kwargs(base), n)
    start_env_workers(workers)
    tasks = list(base.tasks) if base.tasks else list(range(len(workers[0].tasks)))
    with ThreadPoolExecutor(len(workers)) as ex:
        list(ex.map(lambda iw: iw[1].reset_sync(tasks[iw[0] % len(tasks)], 0), enumerate(workers)))
    console.print(f"[bold]bench eval[/] {len(workers)} env(s) started and warmed up in "
                  f"{time.perf_counter() - t0:.1f} s (not part of any row)")


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row over its rounds: the run with the median env steps/s (of an even number of rounds, the lower of the
    two middle ones) gives the row's details, the rates are the medians of every round's; each round's rate, chunk
    figures and auto's shape are kept beside (`*_rounds`), so two rows can be compared round by round."""
    order = sorted(runs, key=lambda x: x["env_steps_per_s"])
    med = dict(order[(len(order) - 1) // 2]) if len(order) % 2 else dict(order[len(order) // 2 - 1])
    rates = [x["env_steps_per_s"] for x in runs]
    med["env_steps_per_s"] = statistics.median(rates)
    med["episodes_per_hour"] = statistics.median(x["episodes_per_hour"] for x in runs)
    med["rounds"] = rates
    if any("auto_shape" in x for x in runs):   # the shape auto kept in each round, and what its probe measured
        med["auto_shapes"] = [x.get("auto_shape", {}).get("shape") for x in runs]
        med["auto_shape_rounds"] = [x.get("auto_shape") for x in runs]
    if any("progress" in x for x in runs):     # each round's pace over time (steady.py compares rows round by round)
        med["progress_rounds"] = [x.get("progress") for x in runs]
    for k in ("sim_worker_ms_mean", "cpu_worker_ms_mean", "render_worker_ms_mean", "task_chunk_ms"):
        if any(x.get(k) for x in runs):         # every round's, so that rows compare round by round (paired), not
            med[k.removesuffix("_mean") + "_rounds"] = [x.get(k) for x in runs]   # only through their median run
    if any("host_cpu" in x for x in runs):     # the host's CPUs in each round (the median run's stays host_cpu)
        med["host_cpu_rounds"] = [x.get("host_cpu") for x in runs]
    med["spread"] = (max(rates) - min(rates)) / med["env_steps_per_s"] if med["env_steps_per_s"] else 0.0
    return med


def row_values(base: EvalConfig, rows: list[str] | None, key: str) -> list[str]:
    """The value of setting `key` in each of `rows` (`ROW @ key=value`), the bench's own where a row sets none."""
    own: Any = base
    for part in key.split("."):
        own = getattr(own, part)
    return [dict(kv.split("=", 1) for kv in _row_parts(r)[1] if "=" in kv).get(key, str(own)).strip()
            for r in rows or []]


def pins_servers(base: EvalConfig, rows: list[str] | None) -> bool:
    """Whether the bench or one of its rows (`ROW @ server.reserve_cpus=N`) pins the servers to CPUs of their own."""
    values = row_values(base, rows, "server.reserve_cpus") + [str(base.server.reserve_cpus)]
    return any(v not in ("", "0") for v in values)


def check_nice_rows(base: EvalConfig, rows: list[str] | None) -> None:
    """Rows with different env_nice share the env workers: between rows their niceness goes down again, which
    needs privileges. Without them: a ConfigError before any row runs, not a failure after some."""
    values = sorted({int(v) for v in row_values(base, rows, "env_nice") if v.isdigit()})   # others: row_config
    if len(values) > 1 and not can_lower_nice(values[0]):
        raise ConfigError(f"rows: env_nice differs between rows ({values}), and this process may not lower a "
                          f"niceness again (not root, RLIMIT_NICE): set env_nice for the whole bench instead")


def row_env_configs(base: EvalConfig, rows: list[str] | None) -> list[EvalConfig]:
    """The bench config with each distinct set of env_args settings the rows make (`ROW @ env_args.k=v`): the env
    configurations other than the bench's own that rows run on."""
    out: dict[str, EvalConfig] = {}
    for row in rows or []:
        pairs = sorted(kv for kv in _row_parts(row)[1] if kv.startswith("env_args."))
        if pairs:
            out.setdefault(" ".join(pairs), load_config(EvalConfig, None, pairs, base=base))
    return list(out.values())


def _row_parts(row: str) -> tuple[str, list[str]]:
    """`ROW @ key=value ...` -> (ROW, ["key=value", ...]); a plain row -> (ROW, [])."""
    name, _, settings = row.partition(" @ ")
    return name.strip(), settings.split()


def row_config(known: dict[str, EvalConfig], row: str) -> EvalConfig:
    """The config of a requested row: a known row's, or `ROW @ key=value ...`: that row's with the given settings
    (only ROW_KEYS; a ConfigError names any other key)."""
    name, pairs = _row_parts(row)
    cfg = known[name]
    if not pairs:
        return cfg
    bad = [kv for kv in pairs if kv.split("=", 1)[0] not in ROW_KEYS or "=" not in kv]
    if bad:
        raise ConfigError(f"rows: {row!r}: a row may set only {', '.join(ROW_KEYS)} (key=value), not {bad}")
    return load_config(EvalConfig, None, pairs, base=cfg)


def round_order(configs: list, k: int) -> list:
    """The rows in round k (0-based): as listed in even rounds, reversed in odd ones (A B C, C B A, A B C ...), so a
    drift of the machine during a round (session 19: rows later in a round ran up to 13% faster) favours no row in
    the median over rounds."""
    return list(configs) if k % 2 == 0 else list(reversed(configs))


def _bench_eval(base: EvalConfig, out: Path, console: Console, rows: list[str] | None, horizon: int,
                runtime: dict[str, Any] | None, rounds: int = 1, with_bound: bool | str = True,
                deadline: RowDeadline | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    m = base.num_envs
    r = dataclasses.replace
    common = dict(resume=False, save_videos=0, progress=False)
    configs: list[tuple[str, EvalConfig]] = [
        ("single-batch", r(base, mode="serial", render_every_step=True, run_to_max_steps=True, **common)),
        ("serial", r(base, mode="serial", render_every_step=False, run_to_max_steps=True, **common)),
    ]
    for b, p in grid(m):
        configs.append((f"B={b}, P={p}", r(base, mode="pipelines", request_size=b, pipelines=p, num_envs=m,
                                           render_every_step=False, run_to_max_steps=True, **common)))
    configs.append(("auto", r(base, mode="auto", num_envs=m, render_every_step=False, run_to_max_steps=True,
                              **common)))
    configs.append(("auto+", r(base, mode="auto", num_envs=m, render_every_step=False, run_to_max_steps=False,
                               **common)))
    # on request only: auto without its measured choice of shape (the cost model's plan alone), for A/B runs
    configs.append(("auto-plan", r(base, mode="auto", auto_probe=False, num_envs=m, render_every_step=False,
                                   run_to_max_steps=True, **common)))
    if not rows:
        configs = [c for c in configs if c[0] != "auto-plan"]
    else:
        known = dict(configs)
        unknown = [x for x in rows if _row_parts(x)[0] not in known]
        if unknown:
            raise ConfigError(f"rows: unknown row(s) {unknown}; rows of this plan: {'; '.join(c[0] for c in configs)}"
                              f" (a row may add ' @ key=value ...' with keys {', '.join(ROW_KEYS)})")
        configs = [(x.strip(), row_config(known, x)) for x in dict.fromkeys(rows)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    order: list[list[str]] = []
    deadline = deadline or RowDeadline(None)
    stopped: dict[str, Any] | None = None
    for k in range(rounds):
        order.append([])
        for name, cfg in round_order(configs, k):
            if not deadline.allows(name):
                stopped = {"round": k + 1, "row": name, "elapsed_s": round(deadline.elapsed(), 1),
                           "needed_s": round(deadline.needs(name), 1), "deadline_s": deadline.deadline_s}
                console.print(f"[bold]bench eval[/] deadline_s={deadline.deadline_s:g}: {name} (round {k + 1}) "
                              f"would need {stopped['needed_s']:.0f} s with its bound after {stopped['elapsed_s']:.0f}"
                              " s: no more rows")
                break
            order[-1].append(name)
            slug = _slug(name) if rounds == 1 else f"{_slug(name)}/round{k + 1}"
            cfg = r(cfg, out=str(out / slug))
            console.print(f"[bold]bench eval[/] {name}{'' if rounds == 1 else f' (round {k + 1}/{rounds})'}: "
                          f"mode={cfg.mode} envs={cfg.num_envs} B={cfg.request_size} P={cfg.pipelines}")
            before, quota0, t_row = cpu_times(), cgroup_throttling(), deadline.now()
            s = _run(cfg, console, runtime)
            deadline.record(name, deadline.now() - t_row)
            runs[name].append(_row(name, s, horizon))
            host = shares(before, cpu_times())   # this host's CPUs over the row (a Ray run's other nodes: not seen)
            if host:
                runs[name][-1]["host_cpu"] = host
                quota = throttled(quota0, cgroup_throttling())   # the container's CPU quota stopping it
                if quota:
                    host["throttled"] = quota
            # rows so far, in case the run is cut short (bound and ratios come at the end)
            write_atomic(out / "bench_eval.partial.json",
                         json.dumps({"rows": [x for v in runs.values() for x in v]}, indent=2))
            console.print(f"  {runs[name][-1]['episodes_per_hour']:.0f} episodes/h, "
                          f"{runs[name][-1]['env_steps_per_s']:.1f} env steps/s")
        if stopped:
            break
    incomplete: list[dict[str, Any]] = []
    if stopped and len(order) > 1:   # a round cut short: the report covers the rounds every row finished
        incomplete = [runs[name].pop() for name in order.pop()]
    rounds = len(order)
    results = [_median_row(v) if rounds > 1 else v[0] for v in runs.values() if v]
    sim_steps = inf_obs = bound = batch = None
    contended: dict[str, Any] | None = None
    loop: dict[str, Any] | None = None
    if with_bound:
        # stage bound: simulation alone and inference alone, same envs and plan
        sim = _run(_sim_alone(base, out / "bound_sim", common, runtime), console, runtime)
        sim_steps = sim["throughput"]["env_steps_per_s"]
        batch = bound_batch(base, m)
        inf_obs, call_s = measure_inference(base, batch, task=_first_task(out, configs) or "bench",
                                            workers=(runtime or {}).get("server_workers"), lone_calls=20)
        bound = min(sim_steps, inf_obs * horizon)
        if with_bound == "contended":
            contended = contended_bound(base, out, console, runtime, batch, horizon,
                                        task=_first_task(out, configs) or "bench", common=common)
        loop = loop_bound(m, horizon, sim_steps, (runtime or {}).get("cores") or os.cpu_count() or 1, call_s,
                          row_chunks_s=[(x.get("sim_ms_mean") or 0.0) / 1000.0 for x in results])
    add_ratios(results, bound, contended, loop)
    vs_best = auto_vs_best_fixed(results)
    report = {"rows": results, "bound": {"sim_env_steps_per_s": sim_steps, "inference_obs_per_s": inf_obs,
                                         "inference_batch": batch, "horizon": horizon,
                                         "bound_env_steps_per_s": bound, "contended": contended, "loop": loop,
                                         "honest_env_steps_per_s": honest_bound(bound, contended, loop)},
              "rounds": rounds, "order": order, "auto_vs_best_fixed": vs_best,
              **({"stopped": stopped, "incomplete_round": incomplete} if stopped else {}),
              "steady_vs_best_fixed": steady_vs_best_fixed(results, {k: v["best_fixed"] for k, v in vs_best.items()}),
              "plan": {"env": base.env, "suite": base.suite, "tasks": base.tasks, "trials": base.trials,
                       "num_envs": m, "max_steps": base.max_steps, "policy": base.policy,
                       "policy_args": base.policy_args,
                       # inference=server: servers started once for every row (0: each row started its own)
                       "shared_servers": len((runtime or {}).get("server_workers") or [])}}
    write_atomic(out / "bench_eval.json", json.dumps(report, indent=2))   # a bench killed meanwhile leaves
    write_atomic(out / "bench_eval.md", markdown(report))                 # the last whole file, never half of one
    console.print(table(report))
    for line in auto_lines(report) + steady_lines(report["steady_vs_best_fixed"]) + probe_lines(results) \
            + cycle_lines(results):
        console.print(line)
    return report


def honest_bound(bound: float | None, contended: dict[str, Any] | None, loop: dict[str, Any] | None) -> float | None:
    """The tightest measured ceiling of a row: the contended stage bound where measured (else the separate one),
    and the env-loop bound."""
    stage = contended["bound_env_steps_per_s"] if contended else bound
    got = [b for b in (stage, (loop or {}).get("bound_env_steps_per_s")) if b]
    return min(got) if got else None


def add_ratios(results: list[dict[str, Any]], bound: float | None, contended: dict[str, Any] | None,
               loop: dict[str, Any] | None = None) -> None:
    """Each row's speed-up over the single-batch row (when it comes first) and its share of the bound(s)."""
    base_rate = results[0]["env_steps_per_s"] if results and results[0]["row"] == "single-batch" else None
    base_eph = results[0]["episodes_per_hour"] if base_rate else None
    # single-batch is one env over every task of the plan: each task change is a scene load inside its row, many more
    # per episode than a long single-batch run would pay; its rate without them is the conservative denominator
    steady = None
    if base_rate and results[0].get("scene_load_s"):
        sb = results[0]
        steady = sb["env_steps"] / max(1e-9, sb["wall_s"] - sb["scene_load_s"])
        sb["env_steps_per_s_without_loads"] = steady
    for x in results:
        x["ratio_steps"] = x["env_steps_per_s"] / base_rate if base_rate else None
        x["ratio_steps_without_loads"] = x["env_steps_per_s"] / steady if steady else None
        x["ratio_episodes"] = x["episodes_per_hour"] / base_eph if base_eph else None
        x["of_bound"] = x["env_steps_per_s"] / bound if bound else None
        if contended:
            x["of_contended_bound"] = x["env_steps_per_s"] / contended["bound_env_steps_per_s"]
        if loop:
            x["of_loop_bound"] = x["env_steps_per_s"] / loop["bound_env_steps_per_s"]
            x["of_honest_bound"] = x["env_steps_per_s"] / honest_bound(bound, contended, loop)


def bound_share(report: dict[str, Any]) -> tuple[str, list[float | None]]:
    """The tables' bound column: each row against the honest bound (the tightest measured, `honest_bound`) where the
    run measured it, else against the separate-stage bound; (column name, one value per row)."""
    if any(x.get("of_honest_bound") is not None for x in report["rows"]):
        return "of honest bound", [x.get("of_honest_bound") for x in report["rows"]]
    return "of bound", [x.get("of_bound") for x in report["rows"]]


def render_line(rows: list[dict[str, Any]]) -> str:
    """What the rows' env workers rendered with (summary.scheduler.env_render), one line; "" where no row says
    (no MuJoCo, or a report written before it was recorded)."""
    def txt(r: dict[str, int]) -> str:
        return ", ".join(f"{k} x{v}" for k, v in sorted(r.items()))

    seen = [(x["row"], x.get("env_render") or {}) for x in rows]
    if not any(r for _, r in seen):
        return ""
    kinds = {txt(r) for _, r in seen}
    if len(kinds) == 1:
        return f"Env workers rendered with: {kinds.pop()}."
    return "Env workers rendered with: " + "; ".join(f"{row}: {txt(r) or '-'}" for row, r in seen) + "."


def cycle_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where an env's time goes in each row (timeline.env_cycle): its mean chunk, the mean wait for its next one,
    and how much of that wait is the request's round trip and the server's compute. [] for rows without it."""
    out = []
    for x in rows:
        sim, wait = x.get("sim_ms_mean"), x.get("env_wait_ms_mean")
        if not sim or wait is None:
            continue
        req, comp = x.get("request_ms_mean") or 0.0, x.get("compute_ms_mean") or 0.0
        txt = (f"{x['row']}: an env's cycle {sim + wait:.1f} ms = {chunk_text(sim, *(x.get(k) for k in WORKER_MS_KEYS))} + "
               f"waiting {wait:.1f} for the next one (request {req:.1f}")
        txt += f", server {comp:.1f}" if comp else ""
        batches = batch_sizes_summary(x.get("server_batches"))
        if comp and batches:   # the server's batches (summary.scheduler.server_batches): requests it merged
            txt += f" a batch of {batches[1]:.1f} observations"
        txt += f"; outside the request {wait - req:.1f}: cohort, batch, dispatch)"
        paces = list((x.get("task_chunk_ms") or {}).values())
        if len(paces) > 1:   # a group of envs waits for its slowest task's chunk (summary per_task chunk_ms)
            txt += f"; the tasks' chunks {min(paces):.1f}-{max(paces):.1f} ms"
        host, client = x.get("host_cpu"), x.get("client")
        txt += (f"; host CPUs {100 * host['busy']:.0f}% busy, {100 * host['steal']:.1f}% stolen" if host else "")
        quota = (host or {}).get("throttled")
        if quota and quota["periods"]:   # the container's CPU quota stopped every process for a while
            txt += f", throttled {quota['seconds']:.2f} s in {quota['periods']} periods"
        txt += (f"; the client's loop {100 * client['loop_cpu']:.0f}% of a core, its timers late "
                f"{client['loop_lag_ms']['p50']:.1f} ms (p99 {client['loop_lag_ms']['p99']:.1f})" if client else "")
        stalls = (client or {}).get("stalls")
        if stalls:   # the longest time the loop did not run, and where its thread was (eval/loop_health.py)
            stall = stalls[0]
            where = (stall.get("where") or [""])[0]
            waited = where.startswith("selectors.py")   # the loop was waiting, not running: the host did not run it
            txt += (f", its longest stall {stall['ms']:.0f} ms at {stall['at_s']:.1f} s"
                    + (" in select past its timer (the host did not run the process)" if waited
                       else f" in {where}" if where else ""))
        out.append(txt + ".")
    return out


def auto_vs_best_fixed(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each auto row (auto, auto-plan, with or without `@ key=value` settings; not auto+, whose episodes end at
    success while the fixed rows run to max_steps) against the best fixed (B, P) row of the same run (every
    `B=.., P=..` row, settings included): the ratio of their env steps/s and, over several rounds, round by round
    (the rows of round k ran in round k, next to each other). {} without fixed rows."""
    fixed = [x for x in rows if _row_parts(x["row"])[0].startswith("B=")]
    if not fixed:
        return {}
    best = max(fixed, key=lambda x: x["env_steps_per_s"])
    out = {}
    for x in rows:
        if _row_parts(x["row"])[0] not in ("auto", "auto-plan"):
            continue
        d: dict[str, Any] = {"best_fixed": best["row"], "ratio": x["env_steps_per_s"] / best["env_steps_per_s"]}
        rounds = [f.get("rounds") for f in fixed]
        if x.get("rounds") and all(r and len(r) == len(x["rounds"]) for r in rounds):
            d["per_round"] = [a / max(r[k] for r in rounds) for k, a in enumerate(x["rounds"])]
        out[x["row"]] = d
    return out


def auto_lines(report: dict[str, Any]) -> list[str]:
    """One line per auto row: its share of the best fixed row (auto_vs_best_fixed; computed from the rows for a
    report written before it was recorded). [] without both."""
    out = []
    vs = report.get("auto_vs_best_fixed")
    for row, d in (auto_vs_best_fixed(report.get("rows") or []) if vs is None else vs).items():
        per = d.get("per_round")
        out.append(f"{row}: {d['ratio']:.3f} of the best fixed row ({d['best_fixed']})"
                   + (f"; round by round {', '.join(f'{v:.3f}' for v in per)}" if per else "") + ".")
    return out


def probe_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What auto measured and kept (summary.scheduler.auto_shape), one line per auto row: the shape it began with
    and the figures that chose it, each probe round's rates, after a close call its duel, the kept shape's check
    window, and whether a failed check started the round; the shape kept in every round of the bench. [] where no
    row probed or recorded its start."""
    out = []
    for x in rows:
        a = x.get("auto_shape") or {}
        b = a.get("began_with")
        began = (f"began with {b['shape']} (a chunk {b['chunk_ms']:.1f} ms, a call {b['call_ms']:.1f} ms)"
                 if b else "")
        if not a.get("rounds"):
            if began:   # no round paid back in the row: the start rule (scheduler.start_shape) decided it
                out.append(f"{x['row']} {began} and ran it unprobed (no probe round paid back in the median run).")
            continue
        parts = []
        for r in a["rounds"]:
            rates = ", ".join(f"{k} {v:.1f}" for k, v in r.get("rates_obs_per_s", {}).items())
            duel = r.get("duel_obs_per_s")
            duel_txt = ("; duel " + ", ".join(f"{k} {v:.1f}" for k, v in duel.items())) if duel else ""
            check = r.get("check_obs_per_s")
            check_txt = f", checked at {check:.1f}" if check is not None else ""
            again = "recheck " if r.get("recheck") else ""
            parts.append(f"{again}at {r['at_s']:.1f} s with {r['active']} envs: {rates} obs/s{duel_txt} -> "
                         f"{r['chosen']}{check_txt}")
        kept = x.get("auto_shapes") or [a.get("shape")]
        out.append(f"{x['row']} {began + ', ' if began else ''}kept {', '.join(str(k) for k in kept)} (probe rounds "
                   "of the median run: " + "; ".join(parts) + ").")
    return out


def markdown(report: dict[str, Any]) -> str:
    # per-call times only when the rows have them (reports written before they were recorded do not)
    calls = any(x.get("request_ms_mean") for x in report["rows"])
    rounds = report.get("rounds", 1) > 1
    loads = any("scene_loads" in x for x in report["rows"])   # scene loads inside the row (eval/affinity.py)
    share_name, shares = bound_share(report)
    lines = ["| obs/request (B) x pipelines (P) | episodes | episodes/h | env steps/s | inference obs/s | mean batch "
             f"| x single-batch (steps/s) | x single-batch (episodes/h) | {share_name} |"
             + (" request ms | server compute ms |" if calls else "")
             + (f" spread over {report['rounds']} rounds |" if rounds else "") + (" scene loads |" if loads else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if calls else "") + ("---|" if rounds else "")
             + ("---|" if loads else "")]
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for x, share in zip(report["rows"], shares):
        per_call = (f" {f(x.get('request_ms_mean') or None, '.1f')} | {f(x.get('compute_ms_mean') or None, '.1f')} |"
                    if calls else "")
        lines.append(f"| {x['row']} | {x['episodes']} | {x['episodes_per_hour']:.0f} | {x['env_steps_per_s']:.1f} | "
                     f"{x['inference_obs_per_s']:.2f} | {x['mean_batch']:.1f} | {f(x['ratio_steps'], '.2f')} | "
                     f"{f(x['ratio_episodes'], '.2f')} | {f(share, '.2f')} |" + per_call
                     + (f" {100 * x.get('spread', 0.0):.1f}% |" if rounds else "")
                     + (f" {x.get('scene_loads', '-')} |" if loads else ""))
    b = report["bound"]
    lines.append("")
    st = report.get("stopped")
    if st:   # deadline_s: the rows that did not start, and the round cut short (eval/deadline.py)
        cut = ", ".join(x["row"] for x in report.get("incomplete_round") or [])
        lines += [f"Stopped by deadline_s={st['deadline_s']:g}: {st['row']} (round {st['round']}) would have needed "
                  f"{st['needed_s']:.0f} s with the bound after {st['elapsed_s']:.0f} s; the table covers "
                  f"{report['rounds']} round(s)" + (f" (round {st['round']}'s {cut} left out)" if cut else "") + ".",
                  ""]
    render = render_line(report["rows"])
    if render:
        lines += [render, ""]
    probes = auto_lines(report) + steady_lines(report.get("steady_vs_best_fixed") or {}) + probe_lines(report["rows"])
    if probes:
        lines += probes + [""]
    cycles = cycle_lines(report["rows"])
    if cycles:
        lines += ["Where an env's time goes (means over every env and chunk):", ""] + [f"- {c}" for c in cycles] + [""]
    sb = report["rows"][0] if report["rows"] and report["rows"][0]["row"] == "single-batch" else None
    if sb and sb.get("env_steps_per_s_without_loads"):
        lines.append(f"single-batch loaded {sb['scene_loads']} scene(s) in its row ({sb['scene_load_s']:.1f} s of "
                     f"{sb['wall_s']:.1f} s): without them {sb['env_steps_per_s_without_loads']:.1f} env steps/s; "
                     "x that: " + ", ".join(f"{x['row']} {x['ratio_steps_without_loads']:.2f}"
                                            for x in report["rows"][1:]) + ".")
        lines.append("")
    if b["bound_env_steps_per_s"] is None:
        return "\n".join(lines + ["Stage bound: not measured in this run (bound=false)."]) + "\n"
    lines.append(f"Stage bound: simulation alone {b['sim_env_steps_per_s']:.1f} env steps/s; inference alone "
                 f"{b['inference_obs_per_s']:.2f} obs/s at batch {b['inference_batch']} = "
                 f"{b['inference_obs_per_s'] * b['horizon']:.1f} env steps/s (horizon {b['horizon']}); "
                 f"bound {b['bound_env_steps_per_s']:.1f} env steps/s.")
    c = b.get("contended")
    if c:
        lines.append(f"Contended (both at once): simulation {c['sim_env_steps_per_s']:.1f} env steps/s while "
                     f"inference serves {c['inference_obs_per_s']:.2f} obs/s at batch {c['inference_batch']}; "
                     f"bound {c['bound_env_steps_per_s']:.1f} env steps/s.")
    lp = b.get("loop")
    if lp:
        lines.append(f"Loop bound (an env waits for its own actions): {report['plan']['num_envs']} envs x horizon "
                     f"{b['horizon']} / (chunk {1000 * lp['chunk_s']:.1f} ms{_chunk_from(lp)} + fastest call "
                     f"{1000 * lp['call_s']:.1f} ms) = {lp['bound_env_steps_per_s']:.1f} env steps/s. "
                     f"Honest bound (the tightest measured): "
                     f"{b['honest_env_steps_per_s']:.1f}; rows against it: "
                     + ", ".join(f"{x['row']} {x['of_honest_bound']:.2f}" for x in report["rows"]) + ".")
    return "\n".join(lines) + "\n"


def _chunk_from(lp: dict[str, Any]) -> str:
    """Where the loop bound's chunk came from, when a row's was faster than the simulation-alone run's."""
    if lp.get("chunk_from") != "rows":
        return ""
    return f", a row's mean chunk: the simulation-alone run's was {1000 * lp['sim_alone_chunk_s']:.1f}"


def table(report: dict[str, Any]) -> Table:
    t = Table(title="wamkit bench eval")
    share_name, shares = bound_share(report)
    for c in ("row", "episodes/h", "env steps/s", "infer obs/s", "mean batch", "x single", share_name):
        t.add_column(c, justify="right")
    for x, share in zip(report["rows"], shares):
        t.add_row(x["row"], f"{x['episodes_per_hour']:.0f}", f"{x['env_steps_per_s']:.1f}",
                  f"{x['inference_obs_per_s']:.2f}", f"{x['mean_batch']:.1f}",
                  "-" if x["ratio_steps"] is None else f"{x['ratio_steps']:.2f}",
                  "-" if share is None else f"{share:.2f}")
    return t
