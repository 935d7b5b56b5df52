"""`make demo` twice into the same place (`wamkit demo out=DIR` entry point), and the demo's pieces: its kept env
workers, the per-row spread over rounds. The heavy stages (simulators, training) are replaced by fakes that keep
the real rules about output dirs: an eval refuses a dir that holds results, train one that holds a run, record a
non-empty dir; so a demo that does not clean up after its previous run fails here as it would for a user."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wamkit.cli import demo_cmd
from wamkit.cli.main import main


def _summary(cfg) -> dict:
    per_task = {"0": {"task": "t0", "episodes": cfg.trials, "successes": 0, "success_rate": 0.0}}
    return {"episodes": cfg.trials, "successes": 0, "success_rate": 0.0, "per_task": per_task,
            "throughput": {"episodes_this_run": cfg.trials, "wall_s": 1.0, "episodes_per_hour": 1.0,
                           "env_steps_per_s": 1.0, "inference_obs_per_s": 1.0}}


@pytest.fixture()
def fake_stages(monkeypatch):
    from wamkit.eval import bench, record, runner
    from wamkit.train import config as tconfig, export, trainer
    from wamkit.train.trainer import check_out_dir

    calls: dict[str, int] = {}

    def run_eval(cfg, console=None, **kw):
        out, journal = runner._prepare_out(cfg)          # the real refusal of a dir that holds results
        journal.append({"key": "k0", "success": False})
        journal.close()
        (out / "summary.json").write_text(json.dumps(_summary(cfg)))
        calls["eval"] = calls.get("eval", 0) + 1
        return _summary(cfg)

    def bench_eval(base, out, console=None, rows=None, **kw):
        rep = {"rows": [{"row": r, "env_steps_per_s": 1.0 + i, "ratio_steps": 1.0 + i} for i, r in enumerate(rows)],
               "plan": {}}
        out.mkdir(parents=True, exist_ok=False)         # a leftover round dir would fail here
        (out / "bench_eval.json").write_text(json.dumps(rep))
        return rep

    def rec(cfg, console=None):
        out = Path(cfg.out)
        if out.exists() and any(out.iterdir()):
            raise AssertionError("record into a non-empty dir")
        (out / "meta").mkdir(parents=True)
        (out / "meta" / "info.json").write_text("{}")
        calls["record"] = calls.get("record", 0) + 1

    def train(cfg):
        check_out_dir(cfg)                                # the real refusal of a dir that holds a run
        ck = Path(cfg.out) / "checkpoints" / "step_00000001"
        ck.mkdir(parents=True)
        (Path(cfg.out) / "train_log.jsonl").write_text("{}\n")
        return {}

    def export_checkpoint(ckpt, out):
        Path(out).mkdir(parents=True, exist_ok=False)
        (Path(out) / "wamkit_policy.json").write_text("{}")

    monkeypatch.setattr(runner, "run_eval", run_eval)
    monkeypatch.setattr(bench, "bench_eval", bench_eval)
    monkeypatch.setattr(bench, "warm_envs", lambda *a, **k: None)     # no simulators in this test
    monkeypatch.setattr(record, "record", rec)
    monkeypatch.setattr(trainer, "train", train)
    monkeypatch.setattr(export, "export_checkpoint", export_checkpoint)
    monkeypatch.setattr("wamkit.eval.report.print_report", lambda out, console=None: {})
    _ = tconfig
    return calls


def test_demo_runs_twice_into_the_same_place(tmp_path, fake_stages, capsys):
    out = tmp_path / "demo"
    args = ["demo", f"out={out}", "libero_rounds=2", "demos=2", "trials=2"]
    assert main(args) == 0
    (out / "train" / "stale_marker").write_text("from run 1")
    (out / "my_notes.txt").write_text("not the demo's")
    assert main(args) == 0, capsys.readouterr().err
    err = capsys.readouterr()
    assert "replacing the previous demo's outputs" in err.out
    assert not (out / "train" / "stale_marker").exists()                 # a fresh training run
    assert (out / "my_notes.txt").exists()                                # only the demo's own outputs go
    assert fake_stages["record"] == 1                                     # same settings: demos reused
    assert json.loads((out / "learning_loop.json").read_text())["trained"]["episodes"] == 2
    assert sorted(p.name for p in (out / "libero_bench").iterdir()) == ["round1", "round2", "spread.json"]
    assert main([*args[:-2], "demos=3", "trials=2"]) == 0                 # other settings: recorded again
    assert fake_stages["record"] == 2


def test_demo_explains_each_stage(tmp_path, fake_stages, capsys):
    assert main(["demo", f"out={tmp_path}", "libero_rounds=1"]) == 0
    out = " ".join(capsys.readouterr().out.split())          # rich wraps lines at the terminal width
    assert "What this shows" in out and "0% by construction" in out and "untrained" in out
    assert out.count("What this shows") == 2
    assert "learning_loop.json: MetaWorld success" in out              # where to look, at the end


def test_demo_rejects_unknown_stage(tmp_path, capsys):
    assert main(["demo", f"out={tmp_path}", "stages=libero,lern"]) == 2
    assert "lern" in capsys.readouterr().err


def test_spread_over_rounds():
    def rep(single, auto):
        return {"rows": [{"row": "single-batch", "env_steps_per_s": single, "ratio_steps": 1.0},
                         {"row": "auto", "env_steps_per_s": auto, "ratio_steps": auto / single}]}

    rows = demo_cmd.spread_rows([rep(2.0, 4.0), rep(2.0, 5.0), rep(1.0, 3.0)])
    auto = rows[1]
    assert (auto["ratio_median"], auto["ratio_min"], auto["ratio_max"]) == (2.5, 2.0, 3.0)
    assert auto["env_steps_per_s"] == 4.0 and auto["rounds"] == 3
    assert rows[0]["ratio_median"] == 1.0


class _FakeWorker:
    started = 0

    def __init__(self, env, kwargs, index):
        self.index, self.kwargs, self.running, self.closed = index, kwargs, False, 0

    def start(self):
        if not self.running:
            _FakeWorker.started += 1
            self.running = True
        return self

    def close(self):
        self.closed += 1
        self.running = False


def test_kept_envs_are_built_once_and_closed_by_the_stage(monkeypatch):
    from wamkit.eval import runner

    monkeypatch.setattr(runner, "local_env_workers", lambda env, kw, n: [_FakeWorker(env, kw, i) for i in range(n)])
    _FakeWorker.started = 0
    envs = demo_cmd.KeptEnvs()
    for n in (1, 2, 2, 1):                             # serial rows take one env, auto rows two
        ws = envs(env="libero", kwargs={"suite": "s"}, n=n)
        runner.start_env_workers(ws)
        for w in ws:
            w.close()                                  # what run_eval does at its end: the env keeps running
    assert _FakeWorker.started == 2 and [w.index for w in envs.workers] == [0, 1]
    assert all(w.running for w in envs.workers)
    other = envs(env="libero", kwargs={"suite": "other"}, n=1)   # another configuration: a set of its own
    runner.start_env_workers(other)
    assert _FakeWorker.started == 3 and other[0].kwargs == {"suite": "other"}
    assert envs(env="libero", kwargs={"suite": "s"}, n=2)[1].index == 1   # the first set is still there
    kept = list(envs.workers)
    envs.close()
    assert [w.closed for w in kept] == [1, 1, 1]
