"""A misspelled key is never ignored: every registered policy and env declares its options as a typed config
dataclass (`config_class`) and refuses a key that is not one of them (naming it and listing the valid ones), and
every verb turns that into one line and exit code 2, before any simulator or server starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wamkit.core.config import config_keys, option_names
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


def _valid_keys_line(r, kind: str, name: str, valid: set[str]) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-1500:])
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr[-1500:]
    line = lines[0]
    assert f"{kind}.horizn: not an option of {name!r}; valid keys:" in line or \
        f"{kind}.image_sise: not an option of {name!r}; valid keys:" in line, line
    listed = set(line.split("valid keys: ", 1)[1].split(", "))
    assert listed == valid, (listed, valid)
    return line


@pytest.mark.parametrize("name", policy_names())
def test_eval_refuses_a_misspelled_option_of_every_policy(name, tmp_path):
    r = _cli("eval", "env=metaworld", f"policy={name}", "policy_args.horizn=8", f"out={tmp_path / 'o'}")
    _valid_keys_line(r, "policy_args", name, option_names(policy_class(name)))


@pytest.mark.parametrize("verb", [["bench", "eval", "env=metaworld"], ["serve", "port=0"],
                                  ["data", "record", "env=metaworld"],
                                  ["train", "dataset=tests/fixtures/lerobot_v3_libero_tiny"]], ids=lambda v: v[0])
def test_every_verb_refuses_a_misspelled_policy_option(verb, tmp_path):
    """Every verb that takes policy_args, with a policy whose options are a plain config dataclass (cosmos3)."""
    r = _cli(*verb, "policy=cosmos3", "policy_args.horizn=8", *([] if verb[0] == "serve" else
                                                                 [f"out={tmp_path / 'o'}"]))
    _valid_keys_line(r, "policy_args", "cosmos3", option_names(policy_class("cosmos3")))


@pytest.mark.parametrize("name", env_names())
@pytest.mark.parametrize("verb", [["eval"], ["bench", "eval"], ["data", "record"]], ids=" ".join)
def test_every_verb_refuses_a_misspelled_option_of_every_env(verb, name, tmp_path):
    r = _cli(*verb, f"env={name}", "policy=zero", "env_args.image_sise=8", f"out={tmp_path / 'o'}")
    _valid_keys_line(r, "env_args", name, option_names(env_class(name)))


def test_export_names_its_one_key():
    r = _cli("export", "ckpt", "out", "weight=ema")
    assert r.returncode == 2
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "weights=auto|ema|model" in lines[0], r.stderr


# ---- the typed configs themselves ----------------------------------------------------------------------------------

def _registered():
    return [("policy", n, policy_class(n)) for n in policy_names()] + [("env", n, env_class(n)) for n in env_names()]


@pytest.mark.parametrize("kind,name,cls", _registered(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_registered_class_has_a_typed_documented_config(kind, name, cls):
    """config_class is a dataclass; every key has a type, a default and a one-line meaning (what --help prints)."""
    import dataclasses

    cfg = cls.config_class
    assert dataclasses.is_dataclass(cfg), name
    assert option_names(cls) == {f.name for f in dataclasses.fields(cfg)}
    opaque = {"action_stats", "action_pipeline", "client", "dtype"}     # objects or paths, passed through as given
    for key, tp, default, meaning in config_keys(cfg):
        assert tp != "Any" or key in opaque, (name, key, tp)
        assert default != "(required)", (name, key)
        if (name, key) != ("wam-ref", "image_std"):      # WamRefConfig: image_mean's comment covers both
            assert meaning, f"{cfg.__name__}.{key} has no comment/metadata to explain it"


def test_option_names_requires_a_config_class():
    class Untyped:
        def __init__(self, horizon: int = 16):
            pass

    with pytest.raises(TypeError, match="config_class"):
        option_names(Untyped)


@pytest.mark.parametrize("argv,key", [
    (["eval", "env=metaworld", "policy=fixed-cost", "policy_args.mode=nap"], "policy_args.mode"),
    (["eval", "env=metaworld", "policy=zero", "env_args.max_steps=0"], "env_args.max_steps"),
    (["bench", "eval", "env=metaworld", "policy=zero", "policy_args.horizon=soon"], "policy_args.horizon"),
    (["data", "record", "env=metaworld", "policy=metaworld-expert", "env_args.image_size=0"], "env_args.image_size"),
])
def test_a_bad_option_value_is_one_line_before_anything_starts(argv, key, tmp_path):
    """The config of the policy/env is built (and dropped) by the option check, so a value its config refuses fails
    like a misspelled key: one line naming it, exit 2, nothing written."""
    r = _cli(*argv, f"out={tmp_path / 'o'}")
    assert r.returncode == 2, (r.returncode, r.stderr[-1500:])
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and key in lines[0], r.stderr[-1500:]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("path, kind", [("configs/train_tiny.yaml", "train"), ("configs/serve_example.yaml", "serve"),
                                        ("configs/libero_cosmos3_sglang.yaml", "eval")])
def test_the_shipped_example_configs_load(path, kind):
    """The docs point users at these files: every key in them must be a key of its verb (and its policy's)."""
    from pathlib import Path

    from wamkit.core.config import load_config

    cls = {"train": "wamkit.train.config:TrainConfig", "serve": "wamkit.serve.config:ServeConfig",
           "eval": "wamkit.eval.config:EvalConfig"}[kind]
    mod, name = cls.split(":")
    cfg = load_config(getattr(__import__(mod, fromlist=[name]), name), str(Path(__file__).parents[1] / path), [])
    if getattr(cfg, "policy", None) and not str(cfg.policy).startswith("cosmos3"):
        policy_class(cfg.policy).config_class(**{k: v for k, v in (cfg.policy_args or {}).items()})
