"""`wamkit bench eval [config.yaml] key=value ...`: the scheduler table (see wamkit.eval.bench).

Extra keys: rows=single-batch;auto (subset of rows; `ROW @ key=value ...` adds a row with its own settings, e.g.
`auto @ server.reserve_cpus=2`: keys in wamkit.eval.bench.ROW_KEYS); share_server=true|false (inference=server: one set of local
servers for every row, default true); rounds=N (every row N times, interleaved; median and min-max spread, default 1);
bound=true|false|contended (measure the stage bound after the rows, default true; contended: also both stages at
once, the simulation-alone run while the inference side serves back-to-back batches); deadline_s=S (seconds from
the start: a row starts only if it and the bound can still finish by then, judged from the rows so far; the report
then covers the rounds every row finished). `out=` is the bench directory (one sub-directory per row)."""

from __future__ import annotations

from pathlib import Path

from wamkit.core.config import config_help, load_config, parse_bool, split_args
from wamkit.core.errors import UserError
from wamkit.eval.config import EvalConfig


def help_text(argv: list[str]) -> str:
    from wamkit.cli.eval_cmd import names_footer

    return config_help(EvalConfig, "usage: wamkit bench eval [config.yaml] [rows=ROW;ROW] [share_server=true|false] "
                       "[rounds=N] [bound=true|false|contended] [deadline_s=S] [key=value ...]", __doc__ + "\nEvery `wamkit eval` key below applies to each row.",
                       names_footer())


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "eval":
        raise UserError("usage: wamkit bench eval [config.yaml] key=value ... (other benchmarks live in bench/)")
    path, overrides = split_args(argv[1:])
    rows = None
    share = bound = True
    rounds = 1
    deadline = None
    rest = []
    for o in overrides:
        if o.startswith("rows="):
            rows = [r.strip() for r in o.split("=", 1)[1].split(";") if r.strip()]
        elif o.startswith("share_server="):
            share = parse_bool(o.split("=", 1)[1], "share_server")
        elif o.startswith("bound="):
            v = o.split("=", 1)[1]
            bound = "contended" if v == "contended" else parse_bool(v, "bound")
        elif o.startswith("deadline_s="):
            try:
                deadline = float(o.split("=", 1)[1])
            except ValueError:
                raise UserError(f"deadline_s: expected seconds, got {o.split('=', 1)[1]!r}") from None
        elif o.startswith("rounds="):
            try:
                rounds = int(o.split("=", 1)[1])
            except ValueError:
                raise UserError(f"rounds: expected an integer >= 1, got {o.split('=', 1)[1]!r}") from None
        else:
            rest.append(o)
    cfg = load_config(EvalConfig, path, rest)
    from wamkit.eval.bench import bench_eval
    from wamkit.runtime import eval_runtime

    bench_eval(cfg, Path(cfg.out), rows=rows, horizon=cfg.horizon or 16, runtime=eval_runtime(cfg), share_server=share,
               rounds=rounds, bound=bound, deadline_s=deadline)
    return 0
