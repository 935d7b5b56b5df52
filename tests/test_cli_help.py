"""The first hour of a user at the command line: `wamkit VERB --help` for every verb (every key, its default, valid
choices and a meaning, generated from the config dataclasses), `--version`, one-line hints for `--key=value`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from wamkit.cli.main import VERBS, main
from wamkit.core.config import config_keys

ROOT = Path(__file__).resolve().parents[1]


def _configs():
    from wamkit.cli.demo_cmd import DemoConfig
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.record import RecordConfig
    from wamkit.serve.config import ServeConfig
    from wamkit.train.config import TrainConfig

    return {("eval",): EvalConfig, ("serve",): ServeConfig, ("train",): TrainConfig, ("demo",): DemoConfig,
            ("data", "record"): RecordConfig, ("bench", "eval"): EvalConfig}


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_verb_has_help(verb, flag, capsys):
    assert main([verb, flag]) == 0
    out = capsys.readouterr().out
    assert f"wamkit {verb}" in out and len(out.splitlines()) >= 1


@pytest.mark.parametrize("words,cls", list(_configs().items()), ids=lambda x: " ".join(x) if isinstance(x, tuple)
                         else x.__name__)
def test_help_lists_every_key_with_default_and_meaning(words, cls, capsys):
    assert main([*words, "--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for key, tp, default, meaning in config_keys(cls):
        assert meaning, f"{cls.__name__}.{key} has no comment/metadata to explain it"
        line = next((ln for ln in lines if ln.strip().startswith(f"{key}={default}")), None)
        assert line is not None, f"{key}={default} missing from `wamkit {' '.join(words)} --help`"
    for key, tp, _, _ in config_keys(cls):
        if "|" in tp and "none" not in tp and tp != "true|false":      # a Literal: its choices are listed
            assert f"[{tp}]" in out


def test_help_shows_choices_of_literal_keys(capsys):
    assert main(["eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert "[serial|pipelines|auto]" in out and "[inprocess|server]" in out
    assert "libero" in out and "metaworld" in out and "wam-ref" in out      # registry names


def test_version_and_top_level_help(capsys):
    import wamkit

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"wamkit {wamkit.__version__}"
    assert main(["--help"]) == 0
    assert "--help" in capsys.readouterr().out


@pytest.mark.parametrize("argv,hint", [
    (["eval", "--env=libero"], "env=libero"),
    (["eval", "--env", "libero"], "env=VALUE"),
    (["train", "--steps=10"], "steps=10"),
    (["--env=libero"], "the verb comes first"),
])
def test_dash_style_input_gets_a_one_line_hint(argv, hint, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert hint in err and err.strip().count("\n") == 0


def test_console_entry_point_help_and_version():
    """The installed way: a fresh interpreter, exit codes as a shell sees them."""
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    for argv in (["--version"], ["eval", "--help"]):
        p = subprocess.run([sys.executable, "-m", "wamkit.cli.main", *argv], capture_output=True, text=True,
                           timeout=120, env=env)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() and not p.stderr.strip(), p.stderr
