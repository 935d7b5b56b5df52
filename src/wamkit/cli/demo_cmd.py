"""`wamkit demo`: the whole path on embedded defaults, sized for a 2-core CPU machine (under 10 minutes).

1. LIBERO, pipelined: how fast the scheduler runs an evaluation. A stand-in policy with a known inference cost keeps
   the numbers about scheduling (success is 0% by construction); the rows (single-batch baseline, serial, auto, auto+)
   run in several interleaved rounds on the same two simulators, and the table shows each row's median speed-up over
   the single-batch baseline with its spread (min-max over rounds). Then the same plan through a local action server:
   a per-task report, a timeline PNG and a video.
2. The learning loop on MetaWorld: record expert demonstrations, train `wam-ref` (tiny) on them on the CPU, export it
   in one step, serve it, evaluate trained and untrained with the pipelined scheduler, and report both side by side.

Running it again into the same out= replaces the previous demo's outputs (recorded demonstrations made with the same
settings are reused)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from wamkit.core.config import config_help, load_config, split_args, to_dict
from wamkit.core.errors import ConfigError
from wamkit.eval.config import EvalConfig
from wamkit.eval.kept_envs import KeptEnvs


@dataclass
class DemoConfig:
    out: str = "runs/demo"                  # demo dir; a second run replaces the outputs of the first
    stages: list[str] = field(default_factory=lambda: ["libero", "learn"])  # libero, learn: either or both
    # LIBERO stage
    libero_suite: str = "libero_object"     # the LIBERO suite of stage 1
    libero_tasks: list[int] = field(default_factory=lambda: [0, 1])  # its task ids
    libero_trials: int = 1                  # init states per task in each row of each round
    libero_rounds: int = 2                  # interleaved rounds of the scheduler rows (the spread is over them)
    libero_max_steps: int = 64              # episode cap: enough steps to measure a schedule, not to solve a task
    libero_envs: int = 2                    # simulator processes (about 2.5 GB each), kept for the whole stage
    libero_base_ms: float = 150.0           # stand-in policy: inference cost per request (as a GPU model's) ...
    libero_per_obs_ms: float = 10.0         # ... plus this per observation in the request
    # learning-loop stage (MetaWorld)
    mw_tasks: list[str] = field(default_factory=lambda: ["reach-v3", "button-press-topdown-v3"])  # MetaWorld tasks
    demos: int = 12                         # expert episodes recorded per task (init states 20.., unseen by the eval)
    trials: int = 6                         # evaluation episodes per task (init states not seen in training)
    train_steps: int = 500                  # optimizer steps of the tiny wam-ref
    batch_size: int = 32                    # training batch
    mw_image_size: int = 64                 # camera size the policy sees (and records)
    mw_max_steps: int = 120                 # MetaWorld episode cap
    horizon: int = 8                        # actions per chunk of the trained policy
    eval_envs: int = 2                      # simulator processes of the MetaWorld evaluations

    def validate(self) -> None:
        bad = [s for s in self.stages if s not in ("libero", "learn")]
        if bad or not self.stages:
            raise ConfigError(f"stages: {bad[0] if bad else 'empty'!r} is not a stage; valid choices: libero, learn")
        for name in ("libero_trials", "libero_rounds", "libero_envs", "demos", "trials", "train_steps", "eval_envs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


# what the demo writes under out= (and replaces on the next run); mw_demos is kept when its settings still match
OUTPUTS = ("libero_bench", "libero_eval", "train", "policy", "mw_eval_untrained", "mw_eval_trained",
           "learning_loop.json", "demo.json")
STAGE_NOTES = {
    "libero": (
        "[bold]What this shows:[/] how fast wamkit runs a LIBERO evaluation, not how good a policy is. The policy "
        "is a stand-in (`fixed-cost`): small random actions with a known inference cost of {base:.0f} ms + "
        "{per:.0f} ms per observation, as a model on a GPU would have, so every difference between rows comes from "
        "scheduling, and success is 0% by construction. Episodes stop at {steps} steps: enough chunks to measure a "
        "schedule on 2 cores, not to finish a task.\n"
        "Rows: [bold]single-batch[/] = the reference loop (one env, one observation per request, renders every "
        "step); [bold]serial[/] = one env, renders only what the policy sees; [bold]auto[/] = {envs} envs, "
        "asynchronous batches sized from measurements; [bold]auto+[/] = auto with episodes ending at success.\n"
        "The rows run in {rounds} interleaved rounds on the same {envs} simulators (built once, ~20 s); the summary "
        "gives each row's median speed-up over single-batch and its spread across rounds (other load on the "
        "machine moves single rounds)."),
    "libero_eval": (
        "[bold]Next:[/] the same plan through a local action server (`wamkit serve`, HTTP + msgpack), mode=auto: the "
        "evaluation as you would run it with a real model. Look at {out}/timeline.png: env rows show simulation, "
        "the inference row shows the server computing; the gaps are what scheduling removes."),
    "learn": (
        "[bold]What this shows:[/] the whole learning loop on a task a CPU can learn in minutes. Scripted experts "
        "record {demos} demonstrations per task (LeRobot v3), `wam-ref` tiny (1.7M parameters) trains on them with "
        "the FSDP2 trainer for {steps} steps, is exported in one step, served, and evaluated with the pipelined "
        "scheduler on init states the training never saw. Success rates mean something here: untrained ~0%; "
        "trained, clearly above it. With {trials} episodes per task each task's rate moves in steps of "
        "{step:.0%}, so read the totals, not single tasks."),
}


def help_text(argv: list[str]) -> str:
    return config_help(DemoConfig, "usage: wamkit demo [key=value ...]   (make demo = wamkit demo out=runs/demo)",
                       __doc__, "example: wamkit demo stages=learn train_steps=300 out=runs/demo_learn")


def _note(console: Console, key: str, **kw: Any) -> None:
    console.print(STAGE_NOTES[key].format(**kw), highlight=False)
    console.print()


# ---- outputs --------------------------------------------------------------------------------------------------------

def prepare_out(out: Path, console: Console) -> None:
    """Make out= ready for a fresh demo: the previous demo's outputs go (only the names the demo writes)."""
    old = [n for n in OUTPUTS if (out / n).exists()]
    if old:
        console.print(f"replacing the previous demo's outputs in {out}: {', '.join(old)}")
    for n in old:
        p = out / n
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)


# ---- LIBERO stage ---------------------------------------------------------------------------------------------------

def spread_rows(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row over the rounds of `bench_eval` reports: median / min / max of the speed-up over single-batch (env
    steps/s) and the median env steps/s."""
    names = [x["row"] for x in rounds[0]["rows"]] if rounds else []
    out = []
    for name in names:
        ratios = [x["ratio_steps"] for r in rounds for x in r["rows"] if x["row"] == name and x["ratio_steps"]]
        rates = [x["env_steps_per_s"] for r in rounds for x in r["rows"] if x["row"] == name]
        out.append({"row": name, "rounds": len(rates), "env_steps_per_s": statistics.median(rates) if rates else 0.0,
                    "ratio_median": statistics.median(ratios) if ratios else None,
                    "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None})
    return out


def spread_table(rows: list[dict[str, Any]], rounds: int) -> Table:
    t = Table(title=f"LIBERO scheduler rows: median over {rounds} round(s), spread = min-max")
    for c in ("row", "env steps/s", "x single-batch", "spread"):
        t.add_column(c, justify="right")
    for x in rows:
        med = "-" if x["ratio_median"] is None else f"{x['ratio_median']:.2f}"
        spr = "-" if x["ratio_min"] is None or x["rounds"] < 2 else f"{x['ratio_min']:.2f}-{x['ratio_max']:.2f}"
        t.add_row(x["row"], f"{x['env_steps_per_s']:.1f}", med, spr)
    return t


def libero_stage(cfg: DemoConfig, out: Path, console: Console) -> dict:
    from wamkit.eval.bench import bench_eval, warm_envs
    from wamkit.eval.report import print_report
    from wamkit.eval.runner import run_eval

    console.rule("[bold]1. LIBERO: pipelined evaluation")
    _note(console, "libero", base=cfg.libero_base_ms, per=cfg.libero_per_obs_ms, steps=cfg.libero_max_steps,
          envs=cfg.libero_envs, rounds=cfg.libero_rounds)
    base = EvalConfig(env="libero", suite=cfg.libero_suite, tasks=list(cfg.libero_tasks), trials=cfg.libero_trials,
                      max_steps=cfg.libero_max_steps, num_envs=cfg.libero_envs, policy="fixed-cost",
                      policy_args={"base_ms": cfg.libero_base_ms, "per_obs_ms": cfg.libero_per_obs_ms},
                      progress=False)
    envs = KeptEnvs()
    try:
        console.print(f"building {cfg.libero_envs} LIBERO simulators ({cfg.libero_suite}) ...")
        warm_envs(base, envs, console, cfg.libero_envs)   # each builds a scene before any timed row
        rounds = []
        quiet = Console(quiet=True)
        for r in range(cfg.libero_rounds):
            rep = bench_eval(base, out / "libero_bench" / f"round{r + 1}", quiet,
                             rows=["single-batch", "serial", "auto", "auto+"], runtime={"env_workers": envs})
            rounds.append(rep)
            console.print(f"round {r + 1}/{cfg.libero_rounds}: " + ", ".join(
                f"{x['row']} {x['env_steps_per_s']:.1f} steps/s" for x in rep["rows"]))
        console.print(spread_table(spread_rows(rounds), len(rounds)))
        console.print(f"per-round tables: {out / 'libero_bench'}/round*/bench_eval.md (with the stage bound)")
        summary = {"rounds": len(rounds), "rows": spread_rows(rounds), "plan": rounds[0]["plan"] if rounds else {}}
        (out / "libero_bench" / "spread.json").write_text(json.dumps(summary, indent=2))
        _note(console, "libero_eval", out=out / "libero_eval")
        ev = dataclasses.replace(base, mode="auto", inference="server", save_videos=1, trials=2,
                                 out=str(out / "libero_eval"), progress=True)
        run_eval(ev, console, env_workers=envs)
    finally:
        envs.close()
    print_report(ev.out, console)
    return summary


# ---- learning loop stage --------------------------------------------------------------------------------------------

def _record_settings(cfg: DemoConfig) -> dict[str, Any]:
    return {"tasks": list(cfg.mw_tasks), "demos": cfg.demos, "image_size": cfg.mw_image_size,
            "max_steps": cfg.mw_max_steps}


def learn_stage(cfg: DemoConfig, out: Path, console: Console) -> dict:
    from wamkit.eval.record import RecordConfig, record
    from wamkit.eval.metrics import load_summary
    from wamkit.eval.runner import run_eval
    from wamkit.train.config import TrainConfig
    from wamkit.train.export import export_checkpoint
    from wamkit.train.trainer import train

    console.rule("[bold]2. MetaWorld: record -> train -> export -> serve -> evaluate")
    _note(console, "learn", demos=cfg.demos, steps=cfg.train_steps, trials=cfg.trials, step=1 / max(cfg.trials, 1))
    env_args = {"tasks": list(cfg.mw_tasks)}
    data_dir = out / "mw_demos"
    marker = data_dir / "wamkit_demo_record.json"
    settings = _record_settings(cfg)
    if (data_dir / "meta" / "info.json").exists() and marker.exists() and json.loads(marker.read_text()) == settings:
        console.print(f"reusing the demonstrations in {data_dir} (recorded with the same settings)")
    else:
        if data_dir.exists():
            shutil.rmtree(data_dir)
        record(RecordConfig(env="metaworld", env_args=env_args, episodes=cfg.demos, policy="metaworld-expert",
                            image_size=cfg.mw_image_size, max_steps=cfg.mw_max_steps, out=str(data_dir),
                            only_success=True, trial_start=20), console)
        marker.write_text(json.dumps(settings))
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
    untrained = {**policy_args, "init_seed": 0}    # (was "seed": 0, a key wam-ref silently ignored; same weights)
    for name, policy, pargs in (("untrained", "wam-ref", untrained), ("trained", str(exported), {})):
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
    console = Console()
    prepare_out(out, console)
    (out / "demo.json").write_text(json.dumps(to_dict(cfg), indent=2))
    if "libero" in cfg.stages:
        libero_stage(cfg, out, console)
    if "learn" in cfg.stages:
        learn_stage(cfg, out, console)
    console.print(f"[bold green]demo done[/]: outputs under {out}")
    for name, what in WHERE_TO_LOOK:
        if (out / name).exists():
            console.print(f"  {out / name}: {what}", highlight=False, soft_wrap=True)
    return 0


WHERE_TO_LOOK = (
    ("libero_bench/spread.json", "scheduler rows: median speed-up over single-batch and spread over rounds"),
    ("libero_eval/timeline.png", "when each env simulated and when the server computed"),
    ("libero_eval/videos", "an episode video"),
    ("learning_loop.json", "MetaWorld success, untrained vs trained"),
    ("mw_eval_trained/report.md", "the trained policy's per-task table"),
)
