"""bench eval's deadline_s (eval/deadline.py): a row starts only if it and the bound can still finish in time, and
the report covers the rounds every row finished. Fast: a fake clock, the rows' runs replaced by summaries."""

import json

import pytest

from wamkit.core.config import load_config
from wamkit.core.errors import ConfigError, UserError
from wamkit.eval.config import EvalConfig
from wamkit.eval.deadline import RowDeadline


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_row_starts_only_if_it_and_the_bound_fit():
    clock = Clock()
    d = RowDeadline(60.0, bound="contended", now=clock)
    assert d.allows("a") and d.needs("a") is None          # nothing measured: the first row always starts
    clock.t += 10.0
    d.record("a", 10.0)
    # b has not run: the longest row so far (10 s), the contended bound's two runs (2 x 10), the margin
    assert d.predicted("b") == 10.0 and d.needs("b") == 10.0 + 20.0 + RowDeadline.MARGIN_S
    assert d.allows("b")                                   # 10 s elapsed + 35 <= 60
    clock.t += 20.0
    d.record("b", 20.0)
    assert d.predicted("a") == 10.0 and d.predicted("b") == 20.0   # each row its own longest round
    assert d.needs("a") == 10.0 + 2 * 20.0 + RowDeadline.MARGIN_S and not d.allows("a")   # 30 + 55 > 60
    assert RowDeadline(60.0, bound=False, now=clock).bound_rows == 0
    assert RowDeadline(60.0, bound=True, now=clock).bound_rows == 1
    assert RowDeadline(None, now=clock).allows("a")


def _summary(steps_per_s: float) -> dict:
    return {"throughput": {"episodes_this_run": 4, "wall_s": 1.0, "episodes_per_hour": 100.0,
                           "env_steps_per_s": steps_per_s, "inference_obs_per_s": 1.0, "env_steps": 100},
            "success_rate": 0.0, "scheduler": {}}


def test_bench_rows_stop_at_the_deadline_and_the_report_keeps_whole_rounds(tmp_path, monkeypatch):
    from wamkit.eval import bench

    clock = Clock()
    took = {"pipelines": 10.0, "auto": 12.0}
    ran = []

    def fake_run(cfg, console, runtime=None):
        ran.append(cfg.mode)
        clock.t += took[cfg.mode]
        return _summary(100.0 + len(ran))

    monkeypatch.setattr(bench, "_run", fake_run)
    base = load_config(EvalConfig, None, ["env=metaworld", "num_envs=2", f"out={tmp_path}"])
    # rounds: B, auto | auto, B | B, (auto): round 3's B starts at 44 s (44 + 10 + 5 <= 59), its auto would end
    # at 54 + 12 + 5 > 59: it does not start
    rep = bench._bench_eval(base, tmp_path, bench.Console(file=open(tmp_path / "log", "w")), ["B=2, P=1", "auto"],
                            4, None, rounds=3, with_bound=False, deadline=RowDeadline(59.0, False, now=clock))
    assert ran == ["pipelines", "auto", "auto", "pipelines", "pipelines"]
    assert rep["rounds"] == 2 and rep["order"] == [["B=2, P=1", "auto"], ["auto", "B=2, P=1"]]
    assert rep["stopped"] == {"round": 3, "row": "auto", "elapsed_s": 54.0, "needed_s": 17.0, "deadline_s": 59.0}
    fixed, auto = rep["rows"]
    assert fixed["rounds"] == [101.0, 104.0] and auto["rounds"] == [102.0, 103.0]   # round 3's B=2, P=1 apart
    assert [x["env_steps_per_s"] for x in rep["incomplete_round"]] == [105.0]
    assert rep["auto_vs_best_fixed"]["auto"]["per_round"] == pytest.approx([102 / 101, 103 / 104])
    md = (tmp_path / "bench_eval.md").read_text()
    assert "Stopped by deadline_s=59" in md and "covers 2 round(s) (round 3's B=2, P=1 left out)" in md
    assert json.loads((tmp_path / "bench_eval.json").read_text())["stopped"]["row"] == "auto"


def test_a_deadline_in_the_first_round_keeps_what_ran(tmp_path, monkeypatch):
    from wamkit.eval import bench

    clock = Clock()

    def fake_run(cfg, console, runtime=None):
        clock.t += 30.0
        return _summary(100.0)

    monkeypatch.setattr(bench, "_run", fake_run)
    base = load_config(EvalConfig, None, ["env=metaworld", "num_envs=2", f"out={tmp_path}"])
    rep = bench._bench_eval(base, tmp_path, bench.Console(file=open(tmp_path / "log", "w")), ["B=2, P=1", "auto"],
                            4, None, rounds=3, with_bound=False, deadline=RowDeadline(50.0, False, now=clock))
    assert [r["row"] for r in rep["rows"]] == ["B=2, P=1"] and rep["rounds"] == 1
    assert rep["stopped"]["round"] == 1 and rep["incomplete_round"] == []


def test_deadline_errors():
    from wamkit.cli import bench_cmd
    from wamkit.eval.bench import bench_eval

    with pytest.raises(UserError, match="deadline_s: expected seconds"):
        bench_cmd.main(["eval", "deadline_s=soon"])
    with pytest.raises(ConfigError, match="deadline_s must be > 0"):
        bench_eval(load_config(EvalConfig, None, ["env=metaworld"]), None, deadline_s=0)
