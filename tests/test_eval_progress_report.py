"""Progress text (rates and ETA) and report.md (links the timeline PNG, states utilization): fast, no simulator."""

from __future__ import annotations

import json

import pytest

from wamkit.core.durations import fmt_duration
from wamkit.eval.progress import rate_text
from wamkit.eval.report import print_report
from wamkit.eval.timeline import Timeline


def test_rate_text_gives_the_eta_from_this_runs_rate():
    assert rate_text(0, 0, 10.0, 5) == ""                                # nothing to extrapolate from yet
    assert rate_text(3, 300, 60.0, 9) == "5.0 steps/s 180 ep/h ETA 3m00s"  # 9 more at 20 s each
    assert rate_text(4, 40, 8.0, 0).endswith("done")
    assert rate_text(2, None, 7200.0, 1).endswith("ETA 1h00m") and "steps/s" not in rate_text(2, None, 10.0, 1)
    assert [fmt_duration(s) for s in (0, 59.4, 61, 3600 * 2 + 120)] == ["0s", "59s", "1m01s", "2h02m"]


def test_report_md_links_the_timeline_and_states_utilization(tmp_path):
    summary = {"episodes": 2, "successes": 1, "success_rate": 0.5,
               "per_task": {"0": {"task": "reach", "episodes": 2, "successes": 1, "success_rate": 0.5}},
               "throughput": {"episodes_this_run": 2, "wall_s": 4.0, "episodes_per_hour": 1800.0,
                              "env_steps_per_s": 50.0, "inference_obs_per_s": 5.0}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    tl = Timeline()
    tl.add("env/0", "sim", 0.0, 3.0)
    tl.add("env/1", "sim", 1.0, 2.0)
    tl.add("request", "request", 0.0, 1.0)
    tl.save(tmp_path / "timeline.json")
    print_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "](timeline.png)" in md and (tmp_path / "timeline.png").stat().st_size > 0
    u = tl.utilization()
    assert f"env busy {u['env_busy']:.0%}" in md and f"inference busy {u['inference_busy']:.0%}" in md
    # one sim span per env and no second chunk: the cycle is chunk only (2000 ms mean), no wait measured
    assert "an env's cycle 2000.0 ms = chunk 2000.0 + waiting 0.0 for actions (request 1000.0)" in md
    assert "| 0 | reach | 2 | 1 | 50.0% |" in md
    assert "the server ran" not in md          # no compute spans: the server's batches are not known


def test_report_states_the_servers_batches_from_the_summary(tmp_path):
    """summary.scheduler.server_batches ({size: count}, the server's batches) -> how many and how large."""
    summary = {"episodes": 1, "successes": 0, "success_rate": 0.0, "per_task": {},
               "throughput": {"episodes_this_run": 1, "wall_s": 1.0, "episodes_per_hour": 3600.0,
                              "env_steps_per_s": 10.0, "inference_obs_per_s": 10.0},
               "scheduler": {"env_busy": 0.5, "inference_busy": 0.5, "mean_batch": 2.0,
                             "server_batches": {"1": 2, "4": 1, "16": 1}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    print_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "the server ran 4 batches of 5.5 observations on average (1-16)" in md   # (2 + 4 + 16) / 4


def test_report_states_each_tasks_pace(tmp_path):
    """per_task chunk_ms -> a column in report.md and report.html, and a line naming the fastest and slowest tasks;
    a summary without it (written before the field) gets an empty column and no line."""
    th = {"episodes_this_run": 4, "wall_s": 1.0, "episodes_per_hour": 3600.0, "env_steps_per_s": 10.0,
          "inference_obs_per_s": 10.0}
    per_task = {"0": {"task": "reach", "episodes": 2, "successes": 1, "success_rate": 0.5, "chunk_ms": 9.54},
                "1": {"task": "pick place", "episodes": 2, "successes": 0, "success_rate": 0.0, "chunk_ms": 20.3}}
    summary = {"episodes": 4, "successes": 1, "success_rate": 0.25, "per_task": per_task, "throughput": th}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    print_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| 0 | reach | 2 | 1 | 50.0% | 9.5 |" in md and "| 1 | pick place | 2 | 0 | 0.0% | 20.3 |" in md
    assert "a chunk took 9.5 ms (reach) to 20.3 ms (pick place), 2.13x" in md
    assert "<td>9.5</td>" in (tmp_path / "report.html").read_text()
    for row in per_task.values():
        del row["chunk_ms"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    print_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| 0 | reach | 2 | 1 | 50.0% |  |" in md and "Task pace" not in md


@pytest.mark.slow
@pytest.mark.metaworld
def test_eval_logger_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("metaworld")
    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.runner import run_eval

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(EvalConfig, None, ["env=metaworld", "env_args.tasks=reach-v3", "trials=2", "policy=zero",
                                         "max_steps=5", "image_size=32", "progress=false", f"out={tmp_path}",
                                         "logger=wandb", "wandb_project=wamkit-test"])
    s = run_eval(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert s["episodes"] == 2 and len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_logger_wandb_without_the_package_is_one_user_error(monkeypatch):
    import importlib.util

    from wamkit.core.errors import UserError
    from wamkit.core.tracking import require_wandb

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match="pip install wandb"):
        require_wandb()


@pytest.mark.slow
@pytest.mark.metaworld
def test_eval_progress_says_what_it_waits_for_and_ends_with_rates(tmp_path):
    pytest.importorskip("metaworld")
    import io

    from rich.console import Console

    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.runner import run_eval

    buf = io.StringIO()
    cfg = load_config(EvalConfig, None, ["env=metaworld", "env_args.tasks=reach-v3", "trials=2", "policy=zero",
                                         "max_steps=5", "image_size=32", f"out={tmp_path}"])
    run_eval(cfg, Console(file=buf, width=200, force_terminal=False))
    text = buf.getvalue()
    assert "metaworld env worker(s) ready in" in text            # the env build is announced, not silent
    assert "2/2" in text and "ep/h done" in text                  # rates and the ETA field at the end


def test_a_truncated_summary_or_timeline_is_one_line_naming_the_file(tmp_path, capsys):
    """A probe's finding: `wamkit report` on a directory whose summary.json or timeline.json was cut short (summary
    was not written atomically) printed a JSONDecodeError traceback."""
    from wamkit.cli.main import main
    from wamkit.core.errors import UserError
    from wamkit.eval.timeline import Timeline

    (tmp_path / "summary.json").write_text('{"episodes": 4, "succ')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "summary.json cannot be read" in err and "resume=true" in err
    (tmp_path / "timeline.json").write_text('{"t_origin": 1.0, "spans": [{"lane"')
    with pytest.raises(UserError, match="timeline.json is not a readable timeline"):
        Timeline.load(tmp_path / "timeline.json")


def test_train_and_eval_progress_give_the_time_left_in_one_format():
    """train's plain line read `ETA 0:09:17`, eval's `ETA 9m17s`: one format (core.durations) for both."""
    from wamkit.train.logger import progress_line

    line = progress_line(40, 2000, {"loss": 0.41, "steps_per_s": 3.52, "samples_per_s": 112.6})
    assert line.endswith("| ETA 9m17s")                               # 1960 steps at 3.52/s = 556.8 s
    assert rate_text(10, 1000, 100.0, 30).endswith("ETA 5m00s")
