"""`wamkit data inspect DIR` | `wamkit data stats DIR [horizon=16] [representation=rot6d10|raw] [num_chunks=N]
[seed=0] [out=FILE.json]` | `wamkit data record ...` (wamkit.eval.record)."""

from __future__ import annotations

import json
import sys

from wamkit.core.errors import UserError, unknown_choice
from wamkit.core.files import write_atomic

USAGE = """usage:
  wamkit data inspect DIR                  episodes, frames, fps, features, tasks
  wamkit data stats DIR [horizon=16] [representation=rot6d10|raw] [num_chunks=10000] [seed=0] [out=FILE.json]
                                           stats.json summary; with any of the options, also action-chunk
                                           quantile stats (horizon 16 unless given), which out= writes as JSON
  wamkit data record ...                   record a dataset from a policy in simulation (wamkit.eval.record)"""


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _fmt(v, n=4) -> str:
    import numpy as np

    a = np.asarray(v, dtype=float).reshape(-1)
    return "[" + ", ".join(f"{x:.{n}g}" for x in a[:10]) + (", ..." if a.size > 10 else "") + "]"


def inspect_cmd(root: str) -> int:
    from rich.table import Table

    from wamkit.data.lerobot import LeRobotDataset

    ds = LeRobotDataset(root)
    # every mp4: frame size, frame rate, first frame and the last frame the episodes need; else exit 2 naming it
    n_videos = ds.verify_videos()
    # what training reads: a NaN/inf action or state is an error there (train/data.py), so it is one here
    ds.check_finite([k for k in ("action", "observation.state") if k in ds.features])
    con = _console()
    con.print(f"[bold]{ds.root}[/bold]  LeRobot {ds.info.get('codebase_version')}  robot={ds.info.get('robot_type')}")
    con.print(f"episodes {ds.num_episodes}   frames {len(ds)}   fps {ds.fps}   tasks {len(ds.tasks)}   "
              f"video files {n_videos} (size, fps, first and last needed frame decoded)")
    t = Table(title="features")
    for c in ("name", "dtype", "shape", "details"):
        t.add_column(c)
    for name, f in ds.features.items():
        det = ""
        if f.get("dtype") == "video":
            i = f.get("info", {})
            det = f"{i.get('video.codec')} {i.get('video.pix_fmt')} {i.get('video.fps')} fps"
        elif f.get("names"):
            det = ", ".join(map(str, f["names"]))[:60]
        t.add_row(name, str(f.get("dtype")), str(f.get("shape")), det)
    con.print(t)
    tt = Table(title="tasks")
    tt.add_column("task_index", justify="right")
    tt.add_column("episodes", justify="right")
    tt.add_column("task")
    counts: dict[str, int] = {}
    for e in ds.episodes:
        for task in e.get("tasks") or []:
            counts[task] = counts.get(task, 0) + 1
    for ti, task in sorted(ds.tasks.items()):
        tt.add_row(str(ti), str(counts.get(task, 0)), task)
    con.print(tt)
    lengths = [int(e["length"]) for e in ds.episodes if isinstance(e.get("length"), int)]
    if lengths:
        con.print(f"episode length: min {min(lengths)}  mean {sum(lengths) / len(lengths):.1f}  max {max(lengths)}")
    return 0


def stats_cmd(root: str, overrides: list[str]) -> int:
    from rich.table import Table

    from wamkit.core.config import check_number, parse_overrides
    from wamkit.data.lerobot import LeRobotDataset
    from wamkit.data.transforms import ActionPipeline, Rot6dStep, compute_action_stats

    opts = parse_overrides(overrides)
    valid = {"horizon", "representation", "num_chunks", "seed", "out"}
    bad = [k for k in opts if k not in valid]
    if bad:
        raise UserError(f"unknown option {bad[0]!r}; valid: {', '.join(sorted(valid))}")
    nums = {}
    for key, default, lo in (("horizon", 16, 1), ("num_chunks", 10000, 1), ("seed", 0, 0)):
        try:
            nums[key] = int(str(opts.get(key, default)).strip())
        except ValueError:
            raise UserError(f"{key}: expected an integer, got {opts[key]!r}") from None
        check_number(key, nums[key], lo)
    horizon, num_chunks, seed = nums["horizon"], nums["num_chunks"], nums["seed"]
    rep = opts.get("representation", "rot6d10")
    if rep not in ("rot6d10", "raw"):
        raise unknown_choice("representation", rep, ("rot6d10", "raw"))
    if "out" in opts:
        _check_out(str(opts["out"]))
    ds = LeRobotDataset(root, cameras=[])
    con = _console()
    stats_path = ds.root / "meta" / "stats.json"
    stats = ds.stats   # checked where the other meta files are (wamkit.data.metadata.check_stats)
    t = Table(title=str(stats_path))
    for c in ("feature", "count", "min", "max", "mean", "std", "q01", "q99"):
        t.add_column(c)
    for feat, s in stats.items():
        t.add_row(feat, str(_count(s.get("count"))), *(_fmt(s[k], 3) if k in s else "-" for k in
                                                        ("min", "max", "mean", "std", "q01", "q99")))
    con.print(t)
    if opts:   # any option asks for the chunk stats (out= without horizon= wrote nothing, silently)
        pipe = ActionPipeline([Rot6dStep()]) if rep == "rot6d10" else ActionPipeline([])
        st = compute_action_stats(ds, horizon=horizon, pipeline_before_norm=pipe, num_chunks=num_chunks, seed=seed)
        ct = Table(title=f"action chunks: horizon {horizon}, {rep}, {st['num_chunks']} chunks, {st['count']} actions")
        for c in ("dim", "q01", "q50", "q99", "min", "max", "mean", "std"):
            ct.add_column(c, justify="right")
        for d in range(len(st["q01"])):
            ct.add_row(str(d), *(f"{st[k][d]:.4g}" for k in ("q01", "q50", "q99", "min", "max", "mean", "std")))
        con.print(ct)
        if "out" in opts:
            try:
                write_atomic(opts["out"], json.dumps({"representation": rep, **st}, indent=2))
            except OSError as e:
                raise UserError(f"out={opts['out']}: cannot write it ({e.strerror or e})") from None
            con.print(f"wrote {opts['out']}")
    return 0


def _check_out(out: str) -> None:
    """out= names a file this command can create, checked before the stats are computed."""
    from pathlib import Path

    p = Path(out)
    if p.is_dir():
        raise UserError(f"out={out} is a directory; give a file path, e.g. out={p / 'action_stats.json'}")
    if not p.parent.is_dir():
        raise UserError(f"out={out}: its directory {p.parent} does not exist")


def _count(c):
    if isinstance(c, list) and c:
        return c[0]
    return c


def help_text(argv: list[str]) -> str:
    if argv[:1] == ["record"]:
        from wamkit.core.config import config_help
        from wamkit.eval.record import RecordConfig, __doc__ as record_doc

        return config_help(RecordConfig, "usage: wamkit data record [config.yaml] [key=value ...]", record_doc)
    return USAGE + "\n\nwamkit data record --help: every key of data record"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    sub, rest = argv[0], argv[1:]
    if sub == "record":
        from wamkit.eval import record  # written by the eval layer's owner

        return int(record.main(rest) or 0)
    if sub not in ("inspect", "stats"):
        raise UserError(f"unknown data subcommand {sub!r}; valid choices: inspect, stats, record")
    if not rest:
        print(USAGE, file=sys.stderr)
        raise UserError(f"data {sub}: missing dataset directory")
    if sub == "inspect":
        if len(rest) > 1:
            raise UserError(f"data inspect takes one directory, got {rest}")
        return inspect_cmd(rest[0])
    return stats_cmd(rest[0], rest[1:])
