"""Training on a real LeRobot v3 dataset (the tiny LIBERO fixture in tests/fixtures): data errors before training, and the
reference WAM trained -> exported -> loaded by make_policy -> predicting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wamkit.core.config import load_config
from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.train.config import TrainConfig
from wamkit.train.trainer import train

FIXTURE = Path(__file__).parent / "fixtures" / "lerobot_v3_libero_tiny"
pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason=f"fixture {FIXTURE} not present")

BASE = ["policy=wam-ref", "policy_args.size=tiny", f"dataset={FIXTURE}", "fps=10", "num_workers=0",
        "progress=false", "log_every=1", "warmup=1", "batch_size=2"]


def cfg(tmp, *args):
    return load_config(TrainConfig, None, [*BASE, f"out={tmp}", *args])


@pytest.mark.parametrize("args, match", [
    (["fps=20"], "fps"),
    (["cameras=image,wrist_image,front"], "front"),
    (["policy_args.state_dim=9"], "state"),          # the fixture's observation.state has 8 dims
    (["trainable=gen.*,nonexistent.*"], "match no parameter"),
    (["policy_args.action_dim=5"], "action feature 'action' has 7 dims, policy 'wam-ref' predicts 5"),
])
def test_dataset_problems_fail_before_training(tmp_path, args, match):
    with pytest.raises(UserError, match=match):
        train(cfg(tmp_path, "steps=1", *args))
    assert not (tmp_path / "train_log.jsonl").exists()


@pytest.mark.slow
def test_wam_ref_train_export_predict(tmp_path):
    from wamkit.policies import make_policy
    from wamkit.train.export import export_checkpoint

    s = train(cfg(tmp_path / "run", "steps=2", "ema=0.5"))
    assert s["steps"] == 2 and np.isfinite(s["last"]["loss"])
    out = export_checkpoint(tmp_path / "run", tmp_path / "export")
    pol = make_policy(str(out))
    assert any(st.name == "quantile_normalize" for st in pol.action_pipeline.steps)
    g = np.random.default_rng(0)
    obs = Observation(images={c: g.integers(0, 256, (64, 64, 3), dtype=np.uint8) for c in ("image", "wrist_image")},
                      state=None, task="put the bowl on the plate")
    a = pol.predict([obs], [0])
    assert a.shape == (1, 16, 7) and np.isfinite(a).all()


@pytest.mark.parametrize("column,args", [("action", []), ("observation.state", ["policy_args.state_dim=8"])])
def test_non_finite_data_is_refused_before_training(tmp_path, capsys, column, args):
    """A NaN action (or a NaN state the policy reads) trained a NaN model and exited 0: one line naming the data file,
    row and episode, exit 2, nothing trained."""
    import shutil

    from test_data_corrupt import set_cell
    from wamkit.cli.main import main

    root = tmp_path / "ds"
    shutil.copytree(FIXTURE, root)
    path = set_cell(root, column, 5, 2, float("nan"))
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", *BASE, f"dataset={root}", f"out={out}", "steps=2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for s in (repr(column), "row 5 (index 5, episode 0)", str(path)):
        assert s in err, (s, err)
    assert not (out / "train_log.jsonl").exists()
