"""The learning loop end to end on real parts: record MetaWorld expert demos as LeRobot v3 -> train wam-ref (FSDP2
trainer) -> export -> serve (a real `wamkit serve` subprocess) -> evaluate with the pipelined scheduler."""

from __future__ import annotations

import json

import pytest

from wamkit.core.config import load_config


@pytest.mark.slow
@pytest.mark.metaworld
def test_record_train_export_serve_eval(tmp_path):
    from wamkit.data import LeRobotDataset
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.record import RecordConfig, record
    from wamkit.eval.runner import run_eval
    from wamkit.train.config import TrainConfig
    from wamkit.train.export import export_checkpoint
    from wamkit.train.trainer import train

    data = tmp_path / "demos"
    info = record(RecordConfig(env="metaworld", env_args={"tasks": ["reach-v3"]}, episodes=2, trial_start=20,
                               image_size=32, max_steps=40, out=str(data), progress=False, video_codec="h264"))
    assert info["episodes_kept"] == 2
    ds = LeRobotDataset(data)
    assert len(ds.episodes) == 2 and ds.fps == 80
    frame = ds[0]
    assert frame["observation.images.image"].shape == (32, 32, 3) and frame["action"].shape == (4,)
    assert frame["observation.state"].shape == (39,) and frame["task"] == "reach"

    pargs = {"size": "tiny", "cameras": ["image"], "image_size": 32, "state_dim": 39, "action_dim": 4, "horizon": 4}
    cfg = load_config(TrainConfig, None, {"policy": "wam-ref", "dataset": str(data), "fps": 80, "steps": 6,
                                          "batch_size": 8, "warmup": 2, "out": str(tmp_path / "train"),
                                          "save_every": 3, "log_every": 2, "num_workers": 0, "progress": False})
    cfg.policy_args = pargs
    summary = train(cfg)
    assert summary["steps"] == 6
    logs = [json.loads(x) for x in (tmp_path / "train" / "train_log.jsonl").read_text().splitlines()]
    assert logs and all(x["loss"] == x["loss"] for x in logs)   # finite, logged

    exported = export_checkpoint(tmp_path / "train" / "checkpoints", tmp_path / "policy")
    assert (exported / "wamkit_policy.json").exists() and (exported / "model.safetensors").exists()

    ev = load_config(EvalConfig, None, ["env=metaworld", "suite=mt", "env_args.tasks=reach-v3", "trials=1",
                                        "image_size=32", "max_steps=12", f"policy={exported}", "horizon=4",
                                        "mode=auto", "num_envs=1", "inference=server", "progress=false",
                                        f"out={tmp_path / 'eval'}"])
    s = run_eval(ev)
    assert s["episodes"] == 1 and s["scheduler"]["requests"] >= 1
    rec = json.loads((tmp_path / "eval" / "results.jsonl").read_text().splitlines()[0])
    assert rec["steps"] <= 12 and rec["task"] == "reach"
