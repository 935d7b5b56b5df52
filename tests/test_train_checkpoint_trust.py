"""Resume reads the optimizer state through torch DCP, whose metadata is a pickle: a checkpoint another user owns is
refused (one line, exit 2) unless trust_checkpoint=true."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_train_support import BASE_ARGS, losses
from wamkit.cli.main import main
from wamkit.train.checkpoint import list_checkpoints

OTHER_UID = 12345
COMMON = ["steps=4", "batch_size=4", "save_every=0"]


def _chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, name), uid, -1, follow_symlinks=False)
    os.chown(root, uid, -1)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_resume_refuses_a_checkpoint_of_another_user_unless_trusted(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *BASE_ARGS, *COMMON, "stop_at=2", f"out={out}"]) == 0
    ckpt = list_checkpoints(out / "checkpoints")[-1]
    _chown_tree(ckpt, OTHER_UID)
    capsys.readouterr()

    assert main(["train", *BASE_ARGS, *COMMON, f"out={out}", "resume=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trust_checkpoint=true" in err and str(ckpt) in err
    assert f"uid {OTHER_UID}" in err and "Traceback" not in err
    assert sorted(losses(out)) == [1, 2]                 # nothing was trained

    assert main(["train", *BASE_ARGS, *COMMON, f"out={out}", "resume=true", "trust_checkpoint=true"]) == 0
    assert sorted(losses(out)) == [1, 2, 3, 4]           # continued from step 2


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_foreign_file_inside_optim_is_enough_to_refuse(tmp_path):
    from wamkit.core.errors import UserError
    from wamkit.train.checkpoint import check_checkpoint_owner

    step = tmp_path / "step-000001"
    (step / "optim").mkdir(parents=True)
    meta = step / "optim" / ".metadata"
    meta.write_bytes(b"x")
    check_checkpoint_owner(step)                         # all ours: fine
    os.chown(meta, OTHER_UID, -1)
    with pytest.raises(UserError, match=r"\.metadata"):
        check_checkpoint_owner(step)
    check_checkpoint_owner(step, trust=True)
