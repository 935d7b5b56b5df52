"""`wamkit demo`: the whole path on embedded defaults, sized for a 2-core CPU machine.

1. LIBERO, pipelined: the scheduler table on a small libero_object plan (single-batch baseline vs serial vs auto),
   then an evaluation through a local action server in auto mode with a per-task report, a timeline PNG and a video.
2. The learning loop on MetaWorld: record expert demonstrations, train `wam-ref` (tiny) on them on the CPU, export it
   in one step, serve it, evaluate trained and untrained with the pipelined scheduler, and report both side by side.

Keys: out=runs/demo, stages=libero,learn (either or both), train_steps=..., demos=... (per task), trials=... (eval)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from wamkit.core.config import split_args
from wamkit.core.config import load_config
from wamkit.eval.config import EvalConfig


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    stages: list[str] = field(default_factory=lambda: ["libero", "learn"])
    # LIBERO stage
    libero_suite: str = "libero_object"
    libero_tasks: list[int] = field(default_factory=lambda: [0, 1])
    libero_max_steps: int = 64
    libero_envs: int = 2
    # learning-loop stage (MetaWorld)
    mw_tasks: list[str] = field(default_factory=lambda: ["reach-v3", "button-press-topdown-v3"])
    demos: int = 12                 # expert episodes recorded per task (init states 20.., unseen by the eval)
    trials: int = 6                 # evaluation episodes per task (init states not seen in training)
    train_steps: int = 500
    batch_size: int = 32
    mw_image_size: int = 64
    mw_max_steps: int = 120
    horizon: int = 8
    eval_envs: int = 2


def libero_stage(cfg: DemoConfig, out: Path, console: Console) -> dict:
    from wamkit.eval.bench import bench_eval
    from wamkit.eval.report import print_report
    from wamkit.eval.runner import run_eval

    console.rule("[bold]1. LIBERO: pipelined evaluation")
    base = EvalConfig(env="libero", suite=cfg.libero_suite, tasks=list(cfg.libero_tasks), trials=1,
                      max_steps=cfg.libero_max_steps, num_envs=cfg.libero_envs, policy="fixed-cost",
                      policy_args={"base_ms": 150.0, "per_obs_ms": 10.0}, progress=False)
    bench = bench_eval(base, out / "libero_bench", console,
                       rows=["single-batch", "serial", "auto", "auto+"])
    # the same plan through a local action server (fixed-cost policy: its compute shows on the timeline)
    ev = dataclasses.replace(base, mode="auto", inference="server", save_videos=1, trials=2,
                             out=str(out / "libero_eval"), progress=True)
    run_eval(ev, console)
    print_report(ev.out, console)
    return bench


def learn_stage(cfg: DemoConfig, out: Path, console: Console) -> dict:
    from wamkit.eval.record import RecordConfig, record
    from wamkit.eval.report import load_summary
    from wamkit.eval.runner import run_eval
    from wamkit.train.config import TrainConfig
    from wamkit.train.export import export_checkpoint
    from wamkit.train.trainer import train

    console.rule("[bold]2. MetaWorld: record -> train -> export -> serve -> evaluate")
    env_args = {"tasks": list(cfg.mw_tasks)}
    data_dir = out / "mw_demos"
    if not (data_dir / "meta" / "info.json").exists():
        record(RecordConfig(env="metaworld", env_args=env_args, episodes=cfg.demos, policy="metaworld-expert",
                            image_size=cfg.mw_image_size, max_steps=cfg.mw_max_steps, out=str(data_dir),
                            only_success=True, trial_start=20), console)
    policy_args = {"size": "tiny", "cameras": ["image"], "image_size": cfg.mw_image_size, "state_dim": 39,
                   "action_dim": 4, "horizon": cfg.horizon}
    tcfg = load_config(TrainConfig, None, {
        "policy": "wam-ref", "dataset": str(data_dir), "steps": cfg.train_steps, "batch_size": cfg.batch_size,
        "warmup": 50, "lr": 1e-3, "out": str(out / "train"), "save_every": 0, "log_every": 25, "num_workers": 0})
    tcfg.policy_args = policy_args
    from wamkit.envs.metaworld import CONTROL_HZ

    tcfg.fps = CONTROL_HZ   # the recipe's time scale: MetaWorld's control rate, which the recording keeps
    train(tcfg)
    exported = out / "policy"
    export_checkpoint(out / "train" / "checkpoints", exported)
    rows = {}
    for name, policy, pargs in (("untrained", "wam-ref", {**policy_args, "seed": 0}), ("trained", str(exported), {})):
        ev = EvalConfig(env="metaworld", suite="mt", env_args=env_args, trials=cfg.trials, trial_start=0,
                        image_size=cfg.mw_image_size, max_steps=cfg.mw_max_steps, policy=policy, policy_args=pargs,
                        horizon=cfg.horizon, mode="auto", num_envs=cfg.eval_envs, inference="server",
                        out=str(out / f"mw_eval_{name}"), save_videos=1)
        run_eval(ev, console)
        rows[name] = load_summary(ev.out)
    t = Table(title="MetaWorld: wam-ref tiny, untrained vs trained on recorded expert demos")
    t.add_column("task")
    for name in rows:
        t.add_column(name, justify="right")
    for tid, row in rows["trained"]["per_task"].items():
        t.add_row(row["task"], *(f"{r['per_task'][tid]['successes']}/{r['per_task'][tid]['episodes']}"
                                 for r in rows.values()))
    t.add_row("all", *(f"{r['successes']}/{r['episodes']} ({r['success_rate']:.0%})" for r in rows.values()))
    console.print(t)
    result = {name: {"success_rate": r["success_rate"], "successes": r["successes"], "episodes": r["episodes"]}
              for name, r in rows.items()}
    (out / "learning_loop.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str]) -> int:
    path, overrides = split_args(argv)
    cfg = load_config(DemoConfig, path, overrides)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    if "libero" in cfg.stages:
        libero_stage(cfg, out, console)
    if "learn" in cfg.stages:
        learn_stage(cfg, out, console)
    console.print(f"[bold green]demo done[/]: outputs under {out}")
    return 0
