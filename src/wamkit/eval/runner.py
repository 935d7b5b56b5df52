"""`wamkit eval` end to end: plan -> env workers + inference -> scheduler -> journal -> summary, report, videos."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from wamkit.core.config import to_dict
from wamkit.core.errors import UserError
from wamkit.core.versions import versions
from wamkit.envs.base import env_class
from wamkit.eval.config import EvalConfig
from wamkit.eval.inference import InProcessInference, ServerInference
from wamkit.eval.journal import Journal
from wamkit.eval.metrics import summarize
from wamkit.eval.plan import plan_for_tasks
from wamkit.eval.scheduler import EpisodeOutcome, Scheduler, SchedulerOptions
from wamkit.eval.timeline import Timeline
from wamkit.policies.registry import is_export_dir, make_policy, policy_class

# config keys that define *what* is evaluated; a resumed run must agree on them
PLAN_KEYS = ("env", "suite", "tasks", "trials", "trial_start", "policy", "policy_args", "horizon", "max_steps",
             "image_size", "env_args", "seed", "run_to_max_steps")


def env_kwargs(cfg: EvalConfig) -> dict[str, Any]:
    kw = {"suite": cfg.suite, "image_size": cfg.image_size, "seed": cfg.seed, **cfg.env_args}
    if cfg.max_steps is not None:
        kw["max_steps"] = cfg.max_steps
    return kw


def policy_kwargs(cfg: EvalConfig, action_dim: int) -> dict[str, Any]:
    kw = {"action_dim": action_dim, **cfg.policy_args}
    if cfg.horizon is not None:
        kw["horizon"] = cfg.horizon
    return kw


def _check_names(cfg: EvalConfig) -> None:
    env_class(cfg.env)                     # raises "unknown env ...; valid choices: ..."
    if not is_export_dir(cfg.policy):
        policy_class(cfg.policy)


def _prepare_out(cfg: EvalConfig) -> tuple[Path, Journal]:
    out = Path(cfg.out)
    results = out / "results.jsonl"
    cfg_path = out / "config.json"
    if results.exists() and not cfg.resume:
        raise UserError(f"{out} already holds results; pass resume=true to continue it or choose another out=")
    if cfg.resume and cfg_path.exists():
        old = json.loads(cfg_path.read_text())
        new = to_dict(cfg)
        diff = [k for k in PLAN_KEYS if old.get(k) != new.get(k)]
        if diff:
            raise UserError(f"resume=true but {out} was evaluated with different {', '.join(diff)}")
    out.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(json.dumps(to_dict(cfg), indent=2))
    return out, Journal(results)


def local_env_workers(env: str, kwargs: dict[str, Any], n: int):
    """The default runtime: one spawned process per env on this machine."""
    from wamkit.envs.worker import EnvWorker

    return [EnvWorker(env, kwargs, index=i) for i in range(n)]


def _start_workers(workers) -> None:
    """Start every env worker (in parallel); a user error inside the env (unknown suite...) becomes a UserError."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(len(workers)) as ex:
            list(ex.map(lambda w: w.start(), workers))
    except RuntimeError as e:
        msg = getattr(e, "msg", "")
        for kind in ("UserError: ", "ConfigError: "):
            if kind in msg:
                raise UserError(msg.split(kind, 1)[1].splitlines()[0]) from None
        raise


def run_eval(cfg: EvalConfig, console: Console | None = None, *, env_workers=None, server_worker_factory=None,
             server_workers=None, cores: int | None = None) -> dict[str, Any]:
    """Run an evaluation; returns the summary (also written to OUT/summary.json).

    Where the workers run is injected by the caller (the runtime layer, see `wamkit.runtime.eval_runtime`):
    env_workers(env, env_kwargs, n) -> env worker handles (default: local processes); server_worker_factory(**kw)
    -> a ServerWorker for inference=server (default: a local `wamkit serve` subprocess); server_workers: servers
    the caller started and keeps (used instead of starting any, restarted if they stop answering, left running);
    cores: CPU cores the envs share (default: this machine's), used by the auto scheduler's cost model."""
    console = console or Console(stderr=True)
    _check_names(cfg)
    if cfg.runtime != "local" and env_workers is None:
        raise UserError(f"runtime={cfg.runtime} needs the runtime layer: run it through `wamkit eval` or pass "
                        f"wamkit.runtime.eval_runtime(cfg) to run_eval")
    n_envs = 1 if cfg.mode == "serial" else cfg.num_envs
    workers = (env_workers or local_env_workers)(cfg.env, env_kwargs(cfg), n_envs)
    inference = None
    journal = None
    try:
        _start_workers(workers)
        spec, tasks = workers[0].spec, workers[0].tasks
        plan = plan_for_tasks(cfg.suite, tasks, cfg.tasks, cfg.trials, cfg.trial_start, f"{cfg.env}/{cfg.suite}")
        pkw = policy_kwargs(cfg, spec.action_dim)
        if cfg.inference == "inprocess":
            policy = make_policy(cfg.policy, **pkw)
        out, journal = _prepare_out(cfg)
        todo = [ep for ep in plan if not journal.done(ep.key)]
        timeline = Timeline()
        if cfg.inference == "inprocess":
            inference = InProcessInference(policy, timeline)
        else:
            inference = ServerInference(policy=cfg.policy, policy_args=pkw, options=cfg.server, timeline=timeline,
                                        worker_factory=server_worker_factory, workers=server_workers)
        group = cfg.group_by_task if cfg.group_by_task is not None else False
        opts = SchedulerOptions(mode=cfg.mode, batch=cfg.batch, pipelines=cfg.pipelines, depth=cfg.depth,
                                max_batch=cfg.max_batch, group_by_task=group, run_to_max_steps=cfg.run_to_max_steps,
                                render_every_step=cfg.render_every_step,
                                video_episodes=frozenset(ep.index for ep in plan[:cfg.save_videos]
                                                         if not journal.done(ep.key)),
                                seed=cfg.seed, max_episode_retries=cfg.max_episode_retries,
                                cores=cores or os.cpu_count() or 1)
        run_id = uuid.uuid4().hex[:12]
        if journal.records:
            console.print(f"resuming: {len(journal.records)} of {len(plan)} episodes already done, "
                          f"{len(todo)} to run")
        # the clock starts once the inference side is up: a server's start-up and warm-up (CUDA graphs) is setup,
        # reported as setup_s, not evaluation time (throughput is episodes and env steps over evaluation time)
        clock = {"t0": time.time(), "setup_s": 0.0}
        stats = {"done": 0, "succ": sum(int(r["success"]) for r in journal.records.values()), "steps": 0}
        progress = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("success {task.fields[succ]}"), TextColumn("{task.fields[rate]}"),
                            TimeElapsedColumn(), console=console, disable=not cfg.progress, transient=False)
        bar = progress.add_task("eval", total=len(plan), completed=len(journal.records), succ="-", rate="")
        videos_dir = out / "videos"

        def on_done(o: EpisodeOutcome) -> None:
            ep = o.episode
            rec = {"key": ep.key, "index": ep.index, "suite": ep.suite, "task_id": ep.task_id, "task": ep.task,
                   "trial": ep.trial, "success": o.success, "steps": o.steps, "env_steps": o.env_steps,
                   "wall_s": round(o.wall_s, 3), "env_index": o.env_index, "attempts": o.attempts,
                   "run_id": run_id}
            if o.frames:
                from wamkit.eval.video import write_mp4

                name = f"ep{ep.index:04d}_task{ep.task_id}_trial{ep.trial}_{'success' if o.success else 'fail'}.mp4"
                write_mp4(videos_dir / name, o.frames, fps=spec.control_hz)
                rec["video"] = f"videos/{name}"
            journal.append(rec)
            stats["done"] += 1
            stats["succ"] += int(o.success)
            stats["steps"] += o.env_steps
            el = time.time() - clock["t0"]
            n_total = len(journal.records)
            progress.update(bar, advance=1, succ=f"{stats['succ']}/{n_total} ({stats['succ'] / n_total:.0%})",
                            rate=f"{stats['steps'] / el:.1f} steps/s {stats['done'] / el * 3600:.0f} ep/h")

        sched = Scheduler(workers, inference, todo, opts, on_done, timeline)

        async def main():
            t_setup = time.time()
            await inference.start()
            clock["t0"] = time.time()
            clock["setup_s"] = clock["t0"] - t_setup
            try:
                await sched.run()
            finally:
                await inference.close()

        with progress:
            asyncio.run(main())
        wall = time.time() - clock["t0"]
        timeline.save(out / "timeline.json")
        util = timeline.utilization()
        summary = summarize(list(journal.records.values()), wall_s=wall, config=to_dict(cfg), versions=versions(),
                            inference_obs=inference.observations,
                            extra={"run_id": run_id, "scheduler": {
                                "mode": cfg.mode, "num_envs": n_envs, "env_restarts": sched.restarts,
                                "setup_s": round(clock["setup_s"], 3),
                                "server_restarts": getattr(inference, "restarts", 0),
                                "server_requests": list(getattr(inference, "served", [])),
                                "requests": inference.requests,
                                "mean_batch": inference.observations / max(inference.requests, 1),
                                "env_busy": util["env_busy"], "inference_busy": util["inference_busy"],
                                "request_ms_mean": util.get("request_ms_mean", 0.0),
                                "compute_ms_mean": util.get("compute_ms_mean", 0.0)}})
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        if journal is not None:
            journal.close()
        for w in workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001
                pass
