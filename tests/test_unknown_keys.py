"""A misspelled key is never ignored: every registered policy and env refuses a key that is not one of its options
(naming it and listing the valid ones), and every verb turns that into one line and exit code 2, before any
simulator or server starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wamkit.core.config import option_names
from wamkit.core.errors import ConfigError
from wamkit.envs.base import env_class, env_names, make_env
from wamkit.policies import make_policy
from wamkit.policies.catalog import policy_class, policy_names


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_refuses_a_misspelled_option(name):
    valid = option_names(policy_class(name))
    assert valid, name
    with pytest.raises(ConfigError) as e:
        make_policy(name, horizn=8)
    msg = str(e.value)
    assert msg.startswith("policy_args.horizn: not an option of") and all(k in msg for k in valid)


@pytest.mark.parametrize("name", env_names())
def test_every_env_refuses_a_misspelled_option(name):
    valid = option_names(env_class(name))
    with pytest.raises(ConfigError) as e:
        make_env(name, image_sise=64)
    assert str(e.value).startswith("env_args.image_sise: not an option of") and all(k in str(e.value) for k in valid)


def test_the_zero_policy_keeps_its_horizon_only_when_asked():
    """The issue's example: make_policy('zero', horizn=8) used to run with horizon 16."""
    assert make_policy("zero", horizon=8).spec.action.horizon == 8


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "wamkit.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("argv", [
    ["eval", "env=metaworld", "policy=wam-ref", "policy_args.sise=tiny"],
    ["eval", "env=metaworld", "policy=zero", "env_args.foo=1"],
    ["bench", "eval", "env=metaworld", "policy=zero", "policy_args.horizn=8"],
    ["serve", "policy=wam-ref", "policy_args.sise=tiny", "port=0"],
    ["train", "policy=wam-ref", "policy_args.sise=tiny", "dataset=tests/fixtures/lerobot_v3_libero_tiny"],
    ["data", "record", "env=metaworld", "policy=metaworld-expert", "policy_args.speed=2"],
    ["eval", "nosuchkey=1"],
    ["serve", "nosuchkey=1"],
    ["train", "nosuchkey=1"],
    ["data", "record", "nosuchkey=1"],
    ["bench", "eval", "nosuchkey=1"],
    ["demo", "nosuchkey=1"],
])
def test_every_verb_gives_one_line_and_exit_2(argv, tmp_path):
    r = _cli(*argv, f"out={tmp_path / 'o'}") if argv[0] not in ("serve",) else _cli(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-1500:])
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "valid" in lines[0], r.stderr[-1500:]
