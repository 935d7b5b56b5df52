"""Out-of-range numbers in the eval / train / data-record / data-stats configs give one line naming the key and exit
code 2 (no traceback, nothing started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wamkit.cli.main import main
from wamkit.core.config import load_config
from wamkit.core.errors import ConfigError
from wamkit.eval.config import EvalConfig
from wamkit.eval.record import RecordConfig
from wamkit.train.config import TrainConfig


def _one_line_exit_2(capsys, argv, key):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,key", [
    (["eval", "env=metaworld", "image_size=-5"], "image_size"),
    (["eval", "image_size=100000"], "image_size"),
    (["eval", "trials=0"], "trials"),
    (["eval", "horizon=-1"], "horizon"),
    (["eval", "max_steps=0"], "max_steps"),
    (["eval", "num_envs=-2"], "num_envs"),
    (["eval", "server.port=70000"], "server.port"),
    (["eval", "server.max_wait_ms=nan"], "server.max_wait_ms"),
    (["eval", "env_timeout_min_s=0"], "env_timeout_min_s"),
    (["eval", "seed=-1"], "seed"),
    (["eval", "auto_shapes=greedy,fastest"], "auto_shapes"),
    (["eval", "auto_shapes=halves,halves"], "auto_shapes"),
    (["train", "lr=nan"], "lr"),
    (["train", "lr=-1"], "lr"),
    (["train", "fps=0"], "fps"),
    (["train", "horizon=-3"], "horizon"),
    (["train", "betas=0.9,1.5"], "betas"),
    (["train", "eps=inf"], "eps"),
    (["train", "weight_decay=-0.1"], "weight_decay"),
    (["train", "lr_multipliers.inp.*=nan"], "lr_multipliers.inp.*"),    # NaN passed `f < 0` and trained NaN
    (["train", "lr_multipliers.inp.*=inf"], "lr_multipliers.inp.*"),
    (["train", "lr_multipliers.inp.*=-1"], "lr_multipliers.inp.*"),
    (["data", "record", "image_size=-5"], "image_size"),
    (["data", "record", "episodes=0"], "episodes"),
    (["data", "stats", "tests/fixtures/lerobot_v3_libero_tiny", "horizon=-5"], "horizon"),
    (["data", "stats", "tests/fixtures/lerobot_v3_libero_tiny", "num_chunks=x"], "num_chunks"),
])
def test_out_of_range_numbers_exit_2_with_one_line(capsys, argv, key, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])   # the fixture path of the data stats cases
    if argv[0] != "data" or argv[1] == "record":
        argv = [*argv, f"out={tmp_path / 'out'}"]
    _one_line_exit_2(capsys, argv, key)
    assert not (tmp_path / "out").exists()


def test_defaults_and_edges_still_load():
    for cls in (EvalConfig, TrainConfig, RecordConfig):
        load_config(cls, None, [])
    load_config(EvalConfig, None, ["image_size=8", "server.port=65535", "horizon=none", "max_episode_retries=0"])
    load_config(TrainConfig, None, ["fps=10", "decay=0", "grad_clip=0", "betas=0,0.999"])
    with pytest.raises(ConfigError, match="image_size"):
        load_config(RecordConfig, None, ["image_size=0"])


@pytest.mark.parametrize("verb", ["train", "serve", "data record"])
def test_a_config_file_that_is_not_yaml_is_one_line_for_every_verb(tmp_path, capsys, verb):
    """core.config.load_config words PyYAML's error as one line (file, line, column, what it expected): it was the
    parser's several-line excerpt with a caret, for every verb that reads a config file."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 2\nout: [unclosed\n")
    assert main([*verb.split(), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{bad}: invalid YAML at line 3, column 1: expected ',' or ']'" in err, err
