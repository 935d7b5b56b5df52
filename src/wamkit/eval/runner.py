"""`wamkit eval` end to end: plan -> env workers + inference -> scheduler -> journal -> summary, report, videos."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from wamkit.core.config import to_dict
from wamkit.core.cpu_pinning import split_cpus
from wamkit.core.errors import RunError, UserError
from wamkit.core.files import write_atomic
from wamkit.core.heap import frozen_heap
from wamkit.core.secrets import redact
from wamkit.core.versions import versions
from wamkit.envs.base import env_class
from wamkit.envs.render_backend import describe as describe_render
from wamkit.eval.config import EvalConfig
from wamkit.eval.inference import InProcessInference, ServerInference
from wamkit.eval.journal import Journal
from wamkit.eval.loop_health import LoopHealth
from wamkit.eval.metrics import summarize
from wamkit.eval.plan import plan_for_tasks
from wamkit.eval.progress import PlainProgress, rate_text
from wamkit.eval.report import write_report
from wamkit.eval.scheduler import EpisodeOutcome, Scheduler, SchedulerOptions
from wamkit.eval.shape_probe import SHAPES
from wamkit.eval.timeline import Timeline, drop_unreadable_timeline
from wamkit.policies.registry import is_export_dir, make_policy, policy_class

log = logging.getLogger(__name__)

# config keys that define *what* is evaluated; a resumed run must agree on them (dotted: nested; server.policy and
# server.policy_args: what the started servers run, which a probe changed on resume and got results of two policies)
PLAN_KEYS = ("env", "suite", "tasks", "trials", "trial_start", "policy", "policy_args", "horizon", "max_steps",
             "image_size", "env_args", "seed", "run_to_max_steps", "server.policy", "server.policy_args")


def _key(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def plan_diff(old: dict, new: dict, n_tasks: int | None = None) -> list[str]:
    """The PLAN_KEYS on which two configs (to_dict) disagree. `tasks` is compared as the task ids it resolves to
    (None: every task of the suite, 0..n_tasks-1), so tasks=0,1 is the default of a 2-task suite; before the env's
    task count is known (n_tasks None) only where both configs list their tasks."""
    def ids(cfg: dict) -> list[int] | None:
        tasks = cfg.get("tasks")
        return list(range(n_tasks)) if tasks is None and n_tasks is not None else tasks

    a, b = ids(old), ids(new)
    tasks_differ = a is not None and b is not None and a != b
    return [k for k in PLAN_KEYS if (tasks_differ if k == "tasks" else _key(old, k) != _key(new, k))]


def config_record(cfg: EvalConfig) -> dict[str, Any]:
    """The run's config as it is written (config.json, summary.json, the report) and logged (W&B): to_dict with its
    secrets redacted (server.token, policy_args.token, URL userinfo: core/secrets.py)."""
    return redact(to_dict(cfg))


def env_kwargs(cfg: EvalConfig) -> dict[str, Any]:
    kw = {"suite": cfg.suite, "image_size": cfg.image_size, "seed": cfg.seed, **cfg.env_args}
    if cfg.max_steps is not None:
        kw["max_steps"] = cfg.max_steps
    return kw


def policy_kwargs(cfg: EvalConfig, action_dim: int) -> dict[str, Any]:
    """The policy's constructor arguments. `horizon=` builds a policy of that chunk length, except an export's:
    its network was trained for its own chunk, which Inference cuts to the horizon asked for."""
    kw = {"action_dim": action_dim, **cfg.policy_args}
    if cfg.horizon is not None and not is_export_dir(cfg.policy):
        kw["horizon"] = cfg.horizon
    return kw


def served_elsewhere(name: str) -> bool:
    """True for a registered policy whose model runs in another server (it overrides Policy.remote_codec)."""
    from wamkit.policies.base import Policy

    if is_export_dir(name):
        return False
    return policy_class(name).remote_codec is not Policy.remote_codec


def remote_codec_of(name: str, kwargs: dict[str, Any]):
    """The RemoteCodec of a policy whose model runs in another server (cosmos3), else None (nothing is built)."""
    return make_policy(name, **kwargs).remote_codec() if served_elsewhere(name) else None
def inprocess_policy(cfg: EvalConfig, pkw: dict[str, Any]):
    """The policy for inference=inprocess, on cfg.device (auto: a GPU when present) unless policy_args.device says."""
    from wamkit.core.device import resolve_device

    return make_policy(cfg.policy, **{"device": resolve_device(cfg.device), **pkw})


def server_options(cfg: EvalConfig):
    """The server options for inference=server: max_batch_size capped at what this run can send at once
    (EvalConfig.server_batch_cap); an explicit device= travels to every server (`wamkit serve device=...`); auto
    stays auto, so each server decides on its own host (a Ray GPU node, say)."""
    srv = dataclasses.replace(cfg.server, max_batch_size=cfg.server_batch_cap())
    if cfg.device == "auto" or "device" in srv.serve_args:
        return srv
    return dataclasses.replace(srv, serve_args={**srv.serve_args, "device": cfg.device})


def eval_cpu_split(cfg: EvalConfig, kept_servers: bool = False) -> tuple[list[int], list[int]] | None:
    """(server CPUs, env CPUs) of `server.reserve_cpus` (None: off); the servers get theirs where they start
    (start_server_workers), or in run_eval for servers the caller keeps (kept_servers: bench eval's shared ones,
    also beside its in-process simulation-alone run)."""
    reserve = int(cfg.server.reserve_cpus or 0)
    why = (f"runtime={cfg.runtime} places them and the env workers itself" if cfg.runtime != "local" else
           "" if kept_servers else
           "inference=inprocess starts none" if cfg.inference != "server" else
           "with server.url=... it starts none" if cfg.server.url else "")
    if reserve and why:
        raise UserError(f"server.reserve_cpus={reserve} pins the action servers this evaluation starts on this "
                        f"host; {why} (set server.reserve_cpus=0)")
    return split_cpus(reserve)


def check_names(cfg: EvalConfig) -> None:
    """Names and option keys, before any process starts: unknown env/policy, or a key that is not one of their
    options (`policy_args.sise`, `env_args.foo`), is one line naming it and the valid choices."""
    from wamkit.core.config import check_options
    from wamkit.policies.registry import check_args

    check_options("env_args", cfg.env, env_class(cfg.env), env_kwargs(cfg))
    check_args(cfg.policy, cfg.policy_args)   # names, package.module:Class (checked), export dirs


LOCK = ".wamkit-eval.lock"   # in out=: the pid of the evaluation writing there


def _has_records(path: Path) -> bool:
    """True where the journal `path` holds any line (good or bad): episodes of some config were run there."""
    try:
        with open(path, "rb") as f:
            return any(line.strip() for line in f)
    except FileNotFoundError:
        return False


def _resumed_config(cfg: EvalConfig) -> dict | None:
    """The config (OUT/config.json) of the run a resume continues; None for a new run, or a journal without records.
    The journal's records say nothing of the config that ran them: without a config.json to compare with, a resume
    could add episodes of another policy or env to them and the summary count both, so that is one line (UserError)."""
    results, cfg_path = Path(cfg.out) / "results.jsonl", Path(cfg.out) / "config.json"
    if not (cfg.resume and _has_records(results)):
        return None
    try:
        old = json.loads(cfg_path.read_text())
        if not isinstance(old, dict):
            raise ValueError(f"a JSON {type(old).__name__}, not an object")
    except (OSError, ValueError) as e:
        why = "is missing" if isinstance(e, FileNotFoundError) else f"cannot be read ({e})"
        raise UserError(f"resume=true but {cfg_path} {why}, so nothing shows that the results in {results} were "
                        f"evaluated with this config; evaluate into a new out= (or put back that run's "
                        f"config.json)") from None
    return old


def _prepare_out(cfg: EvalConfig) -> tuple[Path, Journal]:
    """out= checked and locked before any worker starts: an out= that is a file or cannot be written, or another
    run's results without resume=true, or a resume that changes what is evaluated (or has no config.json to compare
    with), is one line; a second evaluation into a directory that one is writing is refused (two runs both journaled
    there). This run's config.json is written by _write_config once the plan is known (a resume refused only then
    must leave the old one to compare with)."""
    out = Path(cfg.out)
    results = out / "results.jsonl"
    if results.exists() and not cfg.resume:
        raise UserError(f"{out} already holds results; pass resume=true to continue it or choose another out=")
    _check_same_plan(cfg, out, _resumed_config(cfg))
    try:
        out.mkdir(parents=True, exist_ok=True)
        _lock(out)
    except OSError as e:
        raise UserError(f"out={out} is not a writable directory: {e.strerror or e}") from None
    return out, Journal(results)


def _check_same_plan(cfg: EvalConfig, out: Path, old: dict | None, n_tasks: int | None = None) -> None:
    """A resume that evaluates something else than the run it continues (`old`: that run's config) is one line
    naming the keys (plan_diff). Both are compared redacted, as config.json holds them: a token is not part of what
    is evaluated (another one, or one given another way, is the same plan)."""
    if old is not None and (diff := plan_diff(redact(old), config_record(cfg), n_tasks)):
        raise UserError(f"resume=true but {out} was evaluated with different {', '.join(diff)}")


def _write_config(cfg: EvalConfig, out: Path, n_tasks: int) -> None:
    """OUT/config.json, once the env's tasks are known: a resume whose tasks resolve to other task ids than the
    run it continues is refused first (one line), the old config.json left in place."""
    _check_same_plan(cfg, out, _resumed_config(cfg), n_tasks)
    try:
        write_atomic(out / "config.json", json.dumps(config_record(cfg), indent=2))
    except OSError as e:
        raise UserError(f"out={out} is not a writable directory: {e.strerror or e}") from None


def _lock(out: Path) -> None:
    """Take out='s lock (its file holds our pid); one whose process is gone (killed) is taken over."""
    from wamkit.core.pids import pid_alive

    path = out / LOCK
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                pid = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and pid_alive(pid):
                raise UserError(f"{out} is being written by another evaluation (pid {pid}); wait for it to end, or "
                                f"choose another out=") from None
            path.unlink(missing_ok=True)      # its evaluation ended without removing it (killed): take it over
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return
    raise UserError(f"could not take the lock {path}")


def _unlock(out: Path) -> None:
    path = out / LOCK
    try:
        if int(path.read_text().strip() or 0) == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _log_summary(tracker, summary: dict[str, Any]) -> None:
    """The run's totals into the W&B run summary, the per-task table as a W&B table."""
    import wandb

    th = summary.get("throughput", {})
    tracker.summary.update({"success_rate": summary["success_rate"], "episodes": summary["episodes"],
                            "successes": summary["successes"], **{f"throughput/{k}": v for k, v in th.items()
                                                                  if isinstance(v, (int, float))}})
    rows = [[tid, r.get("task", ""), r["episodes"], r["successes"], r["success_rate"]]
            for tid, r in summary["per_task"].items()]
    tracker.log({"eval/per_task": wandb.Table(columns=["task_id", "task", "episodes", "successes", "success_rate"],
                                              data=rows)})


def local_env_workers(env: str, kwargs: dict[str, Any], n: int):
    """The default runtime: one spawned process per env on this machine."""
    from wamkit.envs.worker import EnvWorker

    return [EnvWorker(env, kwargs, index=i) for i in range(n)]


START_RETRIES = 3   # more starts of an env worker whose process died before its env was built (killed, OOM)


def start_env_worker(w, retries: int = START_RETRIES):
    """Start one env worker; one whose process is killed by a signal while building its env (EnvWorkerCrashed with
    a negative exit code) is started again, up to `retries` more times, as a worker that crashes mid-run is
    restarted; then a RunError naming the worker and how its process ended. An env that raises while being built, or is not built within its
    start_timeout, would do so again: raised at once."""
    from wamkit.envs.worker import EnvWorkerCrashed

    for attempt in itertools.count(1):
        try:
            return w.start()
        except EnvWorkerCrashed as e:
            if e.exit_code is None or e.exit_code >= 0:   # only a process ended by a signal (killed, OOM): an
                raise                                         # exit of its own (an import or GL setup failing) recurs
            if attempt > retries:
                raise RunError(f"env worker {e.index}: {e.msg}, {attempt} times in a row; not started again "
                               f"(its output, above, may say why)") from None
            log.warning("env worker %d: %s; starting it again (%d of %d)", e.index, e.msg, attempt, retries)


def start_env_workers(workers) -> None:
    """Start every env worker (in parallel, start_env_worker); a user error inside the env (unknown suite...)
    becomes a UserError."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(len(workers)) as ex:
            list(ex.map(start_env_worker, workers))
    except RuntimeError as e:
        msg = getattr(e, "msg", "")
        for kind in ("UserError: ", "ConfigError: "):
            if kind in msg:
                raise UserError(msg.split(kind, 1)[1].splitlines()[0]) from None
        raise


def keep_measurements(summary: dict[str, Any], previous: Path) -> dict[str, Any]:
    """A resume with nothing left to run recounts the episodes but measures nothing: the throughput and scheduler
    figures stay those of the last run that ran episodes (`previous` summary.json), not zeros."""
    try:
        old = json.loads(previous.read_text())
    except (OSError, ValueError):
        return summary
    if not isinstance(old, dict):
        return summary
    for key in ("throughput", "scheduler", "run_id", "served_policy"):
        if key in old:
            summary[key] = old[key]
    return summary


def run_eval(cfg: EvalConfig, console: Console | None = None, *, env_workers=None, server_worker_factory=None,
             server_workers=None, cores: int | None = None) -> dict[str, Any]:
    """Run an evaluation; returns the summary (also written to OUT/summary.json).

    Where the workers run is injected by the caller (the runtime layer, see `wamkit.runtime.eval_runtime`):
    env_workers(env, env_kwargs, n) -> env worker handles (default: local processes); server_worker_factory(**kw)
    -> a ServerWorker for inference=server (default: a local `wamkit serve` subprocess); server_workers: servers
    the caller started and keeps (used instead of starting any, restarted if they stop answering, left running);
    cores: CPU cores the envs share (default: this machine's), used by the auto scheduler's cost model."""
    console = console or Console(stderr=True)
    check_names(cfg)
    if cfg.logger == "wandb":
        from wamkit.core.tracking import require_wandb

        require_wandb()
    if cfg.runtime != "local" and env_workers is None:
        raise UserError(f"runtime={cfg.runtime} needs the runtime layer: run it through `wamkit eval` or pass "
                        f"wamkit.runtime.eval_runtime(cfg) to run_eval")
    n_envs = cfg.env_count()
    cpus = eval_cpu_split(cfg, kept_servers=bool(server_workers))
    if cfg.env_nice and cfg.runtime != "local":
        raise UserError(f"env_nice={cfg.env_nice} renices the env worker processes of this host; runtime="
                        f"{cfg.runtime} places them itself (set env_nice=0)")
    if (cfg.env_args or {}).get("renderer", "own") != "own" and cfg.runtime != "local":
        raise UserError(f"env_args.renderer={cfg.env_args['renderer']} draws the frames in render processes of "
                        f"this host; runtime={cfg.runtime} places env workers on other nodes (set "
                        f"env_args.renderer=own)")
    workers = (env_workers or local_env_workers)(cfg.env, env_kwargs(cfg), n_envs)
    for w in workers:
        if hasattr(w, "set_cpus"):   # local processes (not Ray actors: their node schedules them)
            w.set_cpus(cpus[1] if cpus else None)
        if hasattr(w, "set_nice"):
            w.set_nice(cfg.env_nice)
    for w in server_workers or []:   # servers the caller keeps (bench eval's shared ones): this run's split
        if hasattr(w, "set_cpus"):
            w.set_cpus(cpus[0] if cpus else None)
    inference = None
    journal = None
    tracker = None
    out = None
    try:
        out, journal = _prepare_out(cfg)
        t_build = time.time()
        with console.status(f"starting {n_envs} {cfg.env} env worker(s): each builds its simulator "
                            f"(LIBERO: ~15-20 s) ...") if cfg.progress else contextlib.nullcontext():
            start_env_workers(workers)
        if cfg.progress:
            console.print(f"{n_envs} {cfg.env} env worker(s) ready in {time.time() - t_build:.1f} s")
        spec, tasks = workers[0].spec, workers[0].tasks
        plan = plan_for_tasks(cfg.suite, tasks, cfg.tasks, cfg.trials, cfg.trial_start, f"{cfg.env}/{cfg.suite}")
        _write_config(cfg, out, len(tasks))
        pkw = policy_kwargs(cfg, spec.action_dim)
        policy, codec = None, None
        if cfg.inference == "inprocess" or served_elsewhere(cfg.policy):
            policy = inprocess_policy(cfg, pkw)
            codec = policy.remote_codec()
        options = server_options(cfg)
        if codec is not None and cfg.inference == "inprocess":
            # a model that runs in another server (cosmos3 in SGLang) is always reached through the asynchronous
            # server path, so several requests are in flight; its url= is the server
            url = options.url or getattr(policy, "url", None)
            if not url:
                raise UserError(f"policy {cfg.policy!r} runs in {codec.protocol}: give policy_args.url=... (or "
                                f"server.url=...), or inference=server to start servers")
            options = dataclasses.replace(options, url=url)
        if cfg.logger == "wandb":
            from wamkit.core.tracking import start_wandb

            tracker = start_wandb(cfg.wandb_project, out, config_record(cfg), job_type="eval")
        todo = [ep for ep in plan if not journal.done(ep.key)]
        timeline = Timeline()
        if cfg.inference == "inprocess" and codec is None:
            inference = InProcessInference(policy, timeline, batching=(
                (cfg.server.max_batch_size, cfg.server.max_wait_ms) if cfg.inprocess_batching else None))
        else:
            inference = ServerInference(policy=cfg.policy, policy_args=pkw, options=options, timeline=timeline,
                                        worker_factory=server_worker_factory, workers=server_workers, codec=codec,
                                        log_dir=out, horizon=cfg.horizon)
        inference.prepare(spec, cfg.horizon, todo, cfg.seed)   # action dim, horizon; in process: the env checked
        # SGLang batches one prompt per request: requests of one task each unless told otherwise
        sglang = getattr(inference, "protocol", "") == "sglang"
        group = cfg.group_by_task if cfg.group_by_task is not None else sglang
        opts = SchedulerOptions(mode=cfg.mode, request_size=cfg.request_size, pipelines=cfg.pipelines, depth=cfg.depth,
                                max_request_size=cfg.max_request_size, probe=cfg.auto_probe, group_by_task=group,
                                shapes=tuple(cfg.auto_shapes or SHAPES),
                                run_to_max_steps=cfg.run_to_max_steps,
                                render_every_step=cfg.render_every_step,
                                video_episodes=frozenset(ep.index for ep in plan[:cfg.save_videos]
                                                         if not journal.done(ep.key)),
                                seed=cfg.seed, max_episode_retries=cfg.max_episode_retries,
                                cores=cores or (len(cpus[1]) if cpus else os.cpu_count()) or 1,
                                env_timeout_min_s=cfg.env_timeout_min_s,
                                env_timeout_factor=cfg.env_timeout_factor,
                                env_timeout_first_s=cfg.env_timeout_first_s)
        run_id = uuid.uuid4().hex[:12]
        for warning in journal.warnings():
            console.print(f"warning: {warning}", soft_wrap=True, markup=False, highlight=False)
        done_before = [journal.records[ep.key] for ep in plan if journal.done(ep.key)]
        if journal.records:
            console.print(f"resuming: {len(done_before)} of {len(plan)} episodes already done, "
                          f"{len(todo)} to run")
        foreign = len(journal.records) - len(done_before)
        if foreign:
            console.print(f"warning: {out / 'results.jsonl'} holds {foreign} record(s) of episodes outside this plan: "
                          f"kept in the file, left out of the summary", soft_wrap=True, markup=False, highlight=False)
        # the clock starts once the inference side is up: a server's start-up and warm-up (CUDA graphs) is setup,
        # reported as setup_s, not evaluation time (throughput is episodes and env steps over evaluation time)
        clock = {"t0": time.time(), "setup_s": 0.0}
        stats = {"done": 0, "succ": sum(int(r["success"]) for r in done_before), "steps": 0}
        if cfg.progress and not console.is_terminal:   # a log file, CI, `| tee`: rich would draw only at the end
            progress = PlainProgress(console, cfg.progress_every_s)
        else:
            progress = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("success {task.fields[succ]}"), TextColumn("{task.fields[rate]}"),
                                TimeElapsedColumn(), console=console, disable=not cfg.progress, transient=False)
        starting = ("starting the action server(s) (policy load, warm-up) ..." if cfg.inference == "server"
                    else "starting ...")
        bar = progress.add_task("eval", total=len(plan), completed=len(done_before), succ="-", rate=starting)
        videos_dir = out / "videos"
        videos: set[asyncio.Task] = set()   # episodes whose video is being written (recorded once it is on disk)

        def on_done(o: EpisodeOutcome) -> None:
            ep = o.episode
            rec = {"key": ep.key, "index": ep.index, "suite": ep.suite, "task_id": ep.task_id, "task": ep.task,
                   "trial": ep.trial, "success": o.success, "steps": o.steps, "env_steps": o.env_steps,
                   "wall_s": round(o.wall_s, 3), "env_index": o.env_index, "attempts": o.attempts,
                   "actions_digest": o.actions_digest, "chunks": o.chunks, "sim_s": round(o.sim_s, 4),
                   "run_id": run_id}
            if not o.frames:
                record(o, rec)
                return
            from wamkit.eval.video import write_mp4

            name = f"ep{ep.index:04d}_task{ep.task_id}_trial{ep.trial}_{'success' if o.success else 'fail'}.mp4"
            rec["video"] = f"videos/{name}"

            async def write_then_record() -> None:
                # encoded off the event loop (x264 took 121 ms for a LIBERO episode in `make demo`, every env
                # waiting meanwhile); the episode goes to the journal once its video is on disk, so a run killed
                # during the write re-runs it rather than pointing at half a file
                await asyncio.to_thread(write_mp4, videos_dir / name, o.frames, fps=spec.control_hz)
                record(o, rec)

            task = asyncio.get_running_loop().create_task(write_then_record())
            videos.add(task)
            task.add_done_callback(videos.discard)

        def record(o: EpisodeOutcome, rec: dict) -> None:
            journal.append(rec)
            stats["done"] += 1
            stats["succ"] += int(o.success)
            stats["steps"] += o.env_steps
            el = time.time() - clock["t0"]
            n_total = len(done_before) + stats["done"]
            if tracker is not None:
                tracker.log({"eval/episodes": n_total, "eval/success_rate": stats["succ"] / n_total,
                             "eval/episode_success": int(o.success), "eval/episode_steps": o.steps,
                             "eval/env_steps_per_s": stats["steps"] / max(el, 1e-9)}, step=n_total)
            progress.update(bar, advance=1, succ=f"{stats['succ']}/{n_total} ({stats['succ'] / n_total:.0%})",
                            rate=rate_text(stats["done"], stats["steps"], el, len(plan) - n_total))

        sched = Scheduler(workers, inference, todo, opts, on_done, timeline)

        async def first_episode_status() -> None:
            """Until the first episode ends the bar sits at 0/N: say what it is waiting for."""
            while stats["done"] == 0:
                busy = sched.simulating
                what = (f"first episodes: {busy}/{len(workers)} envs busy"
                        + (" (LIBERO builds a task's scene on its first reset)" if cfg.env == "libero" else "")
                        + f", {inference.requests} requests done")
                if wait := inference.waiting_text():   # a predict computing for long: say so
                    what += f"; {wait}"
                progress.update(bar, rate=what)
                await asyncio.sleep(0.5)

        health = LoopHealth()

        async def main():
            t_setup = time.time()
            await inference.start()
            journal.tidy()   # only now that the resume is accepted (its plan, and the server it was evaluated
            # against): a refused one leaves results.jsonl as it found it
            with frozen_heap(cfg.gc_freeze) as frozen:   # full collections then skip what setup built
                clock["gc_frozen"] = frozen
                clock["t0"] = time.time()
                clock["setup_s"] = clock["t0"] - t_setup
                status = asyncio.create_task(first_episode_status()) if cfg.progress and todo else None
                health.start()
                try:
                    await sched.run()
                    while videos:   # the last episodes' videos (their records follow them)
                        await asyncio.gather(*list(videos))
                finally:
                    await health.stop()
                    if status is not None:
                        status.cancel()
                    await inference.close()

        if todo:   # a resume with nothing to run starts no server and measures nothing
            with progress:
                asyncio.run(main())
        wall = time.time() - clock["t0"]
        if timeline.spans or not (out / "timeline.json").exists():   # a resume with nothing to run keeps the last
            timeline.save(out / "timeline.json")
        elif (lost := drop_unreadable_timeline(out / "timeline.json")) is not None:
            console.print(f"warning: {lost}", soft_wrap=True, markup=False, highlight=False)
        util = timeline.utilization()
        planned = [journal.records[ep.key] for ep in plan if journal.done(ep.key)]   # not records of another plan
        summary = summarize(planned, wall_s=wall, config=config_record(cfg), versions=versions(),
                            inference_obs=inference.observations,
                            served_policy=getattr(inference, "served_policy", None),
                            extra={"run_id": run_id, "scheduler": {
                                "mode": cfg.mode, "num_envs": n_envs, "env_restarts": sched.restarts,
                                "env_timeouts": sched.env_timeouts, "scene_loads": sched.affinity.loads,
                                "scene_load_s": round(sched.affinity.load_seconds, 3),
                                "setup_s": round(clock["setup_s"], 3),
                                "env_render": describe_render([w.render for w in workers]),
                                "server_protocol": getattr(inference, "protocol", None),
                                "cpus": None if not cpus else {"server": cpus[0], "envs": cpus[1]},
                                "env_nice": cfg.env_nice,
                                "server_shm_arrays": any(getattr(c, "shm_used", False)
                                                         for c in getattr(inference, "clients", []) or []),
                                "server_restarts": getattr(inference, "restarts", 0),
                                # the most observations a server batch takes (its metadata; capped at the envs)
                                "server_max_batch_size": (inference.max_request_size
                                                          if isinstance(inference, ServerInference) else None),
                                "request_retries": getattr(inference, "request_retries", 0),
                                "server_requests": list(getattr(inference, "served", [])),
                                "requests": inference.requests,
                                "mean_batch": inference.observations / max(inference.requests, 1),
                                "env_busy": util["env_busy"], "inference_busy": util["inference_busy"],
                                "request_ms_mean": util.get("request_ms_mean", 0.0),
                                "compute_ms_mean": util.get("compute_ms_mean", 0.0),
                                "sim_ms_mean": util.get("sim_ms_mean", 0.0),
                                **sched.chunk_costs.summary(),
                                "env_wait_ms_mean": util.get("env_wait_ms_mean", 0.0),
                                "server_batches": timeline.server_batches(),
                                "progress": timeline.progress(),
                                "client": health.summary(),
                                "gc_frozen_objects": clock.get("gc_frozen", 0),
                                "auto_shape": sched.batcher.shape_summary() if sched.batcher else None}})
        if not todo:
            summary = keep_measurements(summary, out / "summary.json")
        write_atomic(out / "summary.json", json.dumps(summary, indent=2))   # a kill leaves the old one or the new
        write_report(out)   # timeline.png, report.md, report.html
        if tracker is not None:
            _log_summary(tracker, summary)
        return summary
    finally:
        if tracker is not None:
            tracker.finish()
        if journal is not None:
            journal.close()
        if out is not None:
            _unlock(out)
        for w in workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001
                pass
