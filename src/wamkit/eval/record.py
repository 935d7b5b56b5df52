"""`wamkit data record env=... policy=... episodes=N out=DIR`: run episodes and write them as a LeRobot v3 dataset.

Every step is observed (the policy is queried with a 1-step chunk budget: the chunk it returns is executed one
action at a time, each observation recorded), so the dataset holds (observation_t, action_t) pairs at the env's
control rate: cameras, state, action, task. `only_success=true` keeps successful episodes only."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from wamkit.core.config import split_args
from wamkit.core.config import check_number, load_config
from wamkit.core.errors import RunError, UserError
from wamkit.eval.config import MAX_IMAGE, MIN_IMAGE
from wamkit.eval.plan import plan_for_tasks, step_seed
from wamkit.eval.progress import rate_text


@dataclass
class RecordConfig:
    env: str = "metaworld"               # simulator: libero | metaworld
    suite: str = ""                      # "" = the env's standard suite (its class's default_suite)
    tasks: list[int] | None = None       # task ids; None = every task of the suite
    episodes: int = 10                   # per task; trial = init-state index 0..episodes-1
    trial_start: int = 0                 # first init-state index
    policy: str = "metaworld-expert"     # the policy that acts (a scripted expert, or any registered policy)
    policy_args: dict[str, Any] = field(default_factory=dict)  # policy constructor keys
    env_args: dict[str, Any] = field(default_factory=dict)  # env options, e.g. env_args.tasks=reach-v3
    image_size: int = 128                # recorded camera frames are image_size x image_size pixels
    max_steps: int | None = None         # None = the suite's standard max steps
    out: str = "runs/dataset"            # the LeRobot v3 dataset dir to write (must not exist or be empty)
    only_success: bool = False           # keep successful episodes only
    video_codec: str = "h264"            # codec of the camera videos
    seed: int = 0                        # env and policy noise seed
    progress: bool = True                # progress bar with ETA on stderr

    def __post_init__(self) -> None:
        if not self.suite:
            from wamkit.envs.base import default_suite

            self.suite = default_suite(self.env)

    def validate(self) -> None:
        for key, lo, hi in (("episodes", 1, None), ("trial_start", 0, None), ("image_size", MIN_IMAGE, MAX_IMAGE),
                            ("seed", 0, 2**63 - 1)):
            check_number(key, getattr(self, key), lo, hi)
        check_number("max_steps", self.max_steps, 1, none_ok=True)


def record(cfg: RecordConfig, console: Console | None = None) -> dict[str, Any]:
    from wamkit.data.writer import LeRobotWriter
    from wamkit.envs.worker import EnvWorker
    from wamkit.policies.registry import make_policy

    console = console or Console(stderr=True)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"out={out} is a file, not a directory; choose another out=")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose another out=")
    created = not out.exists()
    kw = {"suite": cfg.suite, "image_size": cfg.image_size, "seed": cfg.seed, **cfg.env_args}
    if cfg.max_steps is not None:
        kw["max_steps"] = cfg.max_steps
    worker = EnvWorker(cfg.env, kw, index=0)
    from wamkit.core.config import check_options
    from wamkit.envs.base import env_class
    from wamkit.policies.registry import check_args

    check_args(cfg.policy, cfg.policy_args)   # a misspelled key or class path: one line before the simulator starts
    check_options("env_args", cfg.env, env_class(cfg.env), cfg.env_args)
    t_build = time.time()
    if cfg.progress:
        with console.status(f"starting the {cfg.env} env worker (building its simulator) ..."):
            worker.start()
        console.print(f"{cfg.env} env worker ready in {time.time() - t_build:.1f} s")
    else:
        worker.start()
    try:
        spec, tasks = worker.spec, worker.tasks
        plan = plan_for_tasks(cfg.suite, tasks, cfg.tasks, cfg.episodes, cfg.trial_start, cfg.env)
        policy = make_policy(cfg.policy, action_dim=spec.action_dim, **cfg.policy_args)
        features: dict[str, Any] = {}
        for cam in spec.cameras:
            features[f"observation.images.{cam}"] = {"dtype": "video", "shape": [spec.image_size, spec.image_size, 3],
                                                    "names": ["height", "width", "channels"]}
        if spec.state_dim:
            features["observation.state"] = {"dtype": "float32", "shape": [spec.state_dim], "names": None}
        features["action"] = {"dtype": "float32", "shape": [spec.action_dim], "names": None}
        try:   # the writer finalizes on leaving the block, or aborts (its temporary files go) on an error
            with LeRobotWriter(out, fps=int(round(spec.control_hz)), features=features, robot_type=cfg.env,
                               video_codec=cfg.video_codec) as writer:
                kept, succ, t0 = _record_episodes(cfg, worker, policy, spec, plan, writer, console)
                if not kept:   # a finalized dataset without episodes reads as broken ("missing episodes metadata")
                    raise RunError(f"no episode kept: {succ}/{len(plan)} successful with only_success=true; nothing "
                                   f"written to {out}")
        except BaseException:
            if _files_left(out, created):
                console.print(f"incomplete dataset left in {out} (no meta/); delete it", markup=False,
                              highlight=False, soft_wrap=True)
            raise
        info = {"episodes_run": len(plan), "successes": succ, "episodes_kept": kept, "out": str(out),
                "wall_s": time.time() - t0}
        console.print(f"recorded {kept} episodes ({succ}/{len(plan)} successful) to {out}")
        return info
    finally:
        worker.close()


def _record_episodes(cfg: RecordConfig, worker, policy, spec, plan, writer, console: Console) -> tuple[int, int, float]:
    """Run the plan's episodes, each written to `writer` (with only_success, successful ones only):
    (episodes kept, successes, start time)."""
    kept = succ = 0
    t0 = time.time()
    with Progress(TextColumn("[bold]record"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                  disable=not cfg.progress) as progress:
        bar = progress.add_task("record", total=len(plan), info="")
        for ep in plan:
            obs = worker.reset_sync(ep.task_id, ep.trial)
            frames: list[dict[str, Any]] = []
            steps, done, success = 0, False, False
            while not done:
                chunk = policy.predict([obs], [step_seed(cfg.seed, ep, steps)])[0]
                for a in chunk:
                    frame = {f"observation.images.{c}": obs.images[c] for c in spec.cameras}
                    if spec.state_dim:
                        frame["observation.state"] = np.asarray(obs.state, np.float32)
                    frame["action"] = np.asarray(a, np.float32)
                    frames.append(frame)
                    res = worker.execute_sync(a[None], render_every_step=False)
                    steps = res.episode_steps
                    if res.done:
                        done, success = True, bool(res.success)
                        break
                    obs = res.obs
            succ += int(success)
            if success or not cfg.only_success:
                for f in frames:
                    writer.add_frame(f)
                writer.save_episode(task=ep.task)
                kept += 1
            done = ep.index + 1
            progress.update(bar, advance=1, info=f"success {succ}/{done}, kept {kept}, "
                                                 f"{rate_text(done, None, time.time() - t0, len(plan) - done)}")
    return kept, succ, t0


def _files_left(out: Path, created: bool) -> bool:
    """After an aborted writer: remove OUT when this run created it and nothing is left in it. True when OUT still
    holds files of this run (an incomplete dataset: no meta/, never reads as valid)."""
    if created:
        try:
            out.rmdir()   # only when empty
        except OSError:
            pass
    return out.is_dir() and any(out.iterdir())


def main(argv: list[str]) -> int:
    path, overrides = split_args(argv)
    record(load_config(RecordConfig, path, overrides))
    return 0
