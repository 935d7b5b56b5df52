"""The typed contracts: each policy's and env's config dataclass (its defaults build a working object; CLI strings
become typed values; bad values name the key), and the Protocols of wamkit.policies.base (a class lacking a member
fails the check naming that member: the trainer's and the exporter's errors say what is missing)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from wamkit.core.errors import ConfigError, UserError
from wamkit.core.types import Observation
from wamkit.envs.base import env_class
from wamkit.policies import make_policy
from wamkit.policies.base import (ExportablePolicy, InitAfterSharding, Policy, PolicySpec, TrainablePolicy,
                                  contract_members, missing_members)
from wamkit.policies.catalog import policy_class

STATS = {"q01": [-1.0] * 10, "q99": [1.0] * 10}


def _obs(n: int, state_dim: int = 0, task: str = "reach") -> list[Observation]:
    img = np.zeros((8, 8, 3), np.uint8)
    return [Observation(images={"image": img}, state=np.zeros(state_dim, np.float32) if state_dim else None,
                        task=task) for _ in range(n)]


# ---- configs: defaults build a working object ----------------------------------------------------------------------

@pytest.mark.parametrize("name,extra", [("zero", {}), ("random", {}), ("fixed-cost", {"base_ms": 0.0}),
                                        ("metaworld-expert", {})])
def test_default_config_builds_a_policy_that_predicts(name, extra):
    cls = policy_class(name)
    cfg = cls.config_class(**extra)
    pol = cls(config=cfg)
    assert pol.config == cfg and pol.spec.name == name
    n = 3
    state = 39 if name == "metaworld-expert" else 0
    a = pol.predict(_obs(n, state), list(range(n)))
    assert a.shape == (n, cfg.horizon, cfg.action_dim) and a.dtype == np.float32


def test_default_cosmos3_configs_build():
    """cosmos3 needs no server to be built (url is for predict); the stand-in needs the adapter's stats."""
    c = make_policy("cosmos3")
    assert c.config == policy_class("cosmos3").config_class() and c.spec.action.horizon == c.config.horizon
    with pytest.raises(UserError, match="action_stats"):
        make_policy("cosmos3-standin")
    s = make_policy("cosmos3-standin", action_stats=STATS, inner_args={"base_ms": 0})
    assert s.config.inner == "fixed-cost" and s.inner.config.base_ms == 0.0
    a = s.predict([Observation(images={"image": np.zeros((192, 320, 3), np.uint8)}, state=None, task="t")], [1])
    assert a.shape == (1, 16, s.config.padded_action_dim)


def test_env_configs_validate_without_a_simulator():
    lib = env_class("libero").config_class()
    assert lib.episode_steps == 280 and env_class("libero").default_suite == lib.suite
    assert env_class("libero").config_class(suite="libero_10").episode_steps == 520
    mw_cls = env_class("metaworld")
    env = mw_cls()                     # cheap: MetaWorld envs are built per task, at the first reset
    try:
        assert env.config == mw_cls.config_class() and [t.name for t in env.tasks()] == list(env.config.tasks)
        assert env.spec.max_steps == env.config.max_steps and env.spec.env == "metaworld"
    finally:
        env.close()


# ---- configs: typed values, ranges, config= and keywords ----------------------------------------------------------

def test_cli_strings_become_typed_values():
    p = make_policy("fixed-cost", base_ms="0", per_obs_ms="1.5", mode="spin", horizon="4", max_batch_size="8")
    assert p.config.base_ms == 0.0 and p.config.per_obs_ms == 1.5 and p.config.horizon == 4
    assert p.max_batch_size() == 8 and p.spec.action.horizon == 4
    mw = env_class("metaworld").make_config(tasks="reach-v3", cameras="image,wrist_image", max_steps="5")
    assert mw.tasks == ("reach-v3",) and mw.cameras == ("image", "wrist_image") and mw.max_steps == 5
    c = make_policy("cosmos3", seed="none", clip_normalized="true", keys_to_select="moe_gen")
    assert c.config.seed is None and c.config.clip_normalized is True and c.keys_to_select == ("moe_gen",)


@pytest.mark.parametrize("name,kw,match", [
    ("zero", {"horizon": 0}, "policy_args.horizon must be >= 1"),
    ("random", {"action_dim": "x"}, "policy_args.action_dim: expected an integer"),
    ("fixed-cost", {"mode": "nap"}, "policy_args.mode: 'nap' is not one of sleep, spin"),
    ("fixed-cost", {"per_obs_ms": -1}, "policy_args.per_obs_ms must be >= 0"),
    ("metaworld-expert", {"action_dim": 7}, "policy_args.action_dim: metaworld-expert produces 4-D"),
    ("cosmos3", {"horizon": 8}, "policy_args.horizon: cosmos3"),
    ("cosmos3", {"normalization": "both"}, "client, server"),
    ("cosmos3", {"framing": "wide"}, "recipe, rlinf"),
    ("cosmos3-standin", {"padded_action_dim": 4}, "policy_args.padded_action_dim must be >= 10"),
])
def test_bad_values_name_the_key(name, kw, match):
    with pytest.raises(UserError, match=match):
        make_policy(name, **kw)


@pytest.mark.parametrize("name,kw,match", [
    ("libero", {"max_steps": 0}, "env_args.max_steps must be >= 1"),
    ("libero", {"cameras": "top"}, "unknown LIBERO camera"),
    ("libero", {"suite": "libero_100"}, "libero_spatial"),
    ("metaworld", {"tasks": "reach-v9"}, "unknown MetaWorld task"),
    ("metaworld", {"render_quality": "ultra"}, "render_quality"),
    ("metaworld", {"image_size": 0}, "env_args.image_size must be >= 1"),
])
def test_bad_env_values_name_the_key(name, kw, match):
    with pytest.raises(UserError, match=match):
        env_class(name).make_config(**kw)


def test_config_and_keywords_build_the_same_policy():
    cls = policy_class("random")
    a = cls(horizon=8, scale=0.5)
    b = cls(config=cls.config_class(horizon=8, scale=0.5))
    c = cls(config=cls.config_class(horizon=2), horizon=8, scale=0.5)       # keywords win over config=
    assert a.config == b.config == c.config
    obs = _obs(2)
    np.testing.assert_array_equal(a.predict(obs, [3, 4]), c.predict(obs, [3, 4]))
    with pytest.raises(ConfigError, match="policy_args.scal: not an option of 'random'"):
        cls(config=cls.config_class(), scal=1.0)
    assert dataclasses.is_dataclass(a.config)


# ---- the Protocols -------------------------------------------------------------------------------------------------

class _Complete(Policy):
    """Every member of TrainablePolicy (and so ExportablePolicy), nothing else."""

    name = "complete-test"
    config_class = type(make_policy("zero").config)

    def __init__(self):
        self.spec = PolicySpec(name=self.name, trainable=True)
        self.action_pipeline = object()

    module = property(lambda self: object())

    def export_config(self):
        return {}

    def fsdp_units(self):
        return []

    def lr_multipliers(self):
        return {}

    def sft_loss(self, batch):
        return 0.0, {}

    def predict(self, observations, seeds):
        return np.zeros((len(observations), 1, 1), np.float32)


def _without(member: str):
    """An instance of a _Complete subclass on which `member` is missing."""
    attrs = {m: property(lambda self: (_ for _ in ()).throw(AttributeError(m)))
             for m in [member] if m not in ("spec", "action_pipeline")}
    cls = type(f"Without_{member}", (_Complete,), attrs)
    obj = cls()
    if member in ("spec", "action_pipeline"):
        delattr(obj, member)
    return obj


def test_contract_members():
    assert contract_members(ExportablePolicy) == ["spec", "action_pipeline", "module", "export_config"]
    assert contract_members(TrainablePolicy) == [*contract_members(ExportablePolicy), "fsdp_units",
                                                 "lr_multipliers", "sft_loss"]
    assert contract_members(InitAfterSharding) == ["can_init_after_sharding", "init_weights"]
    assert isinstance(_Complete(), TrainablePolicy) and missing_members(_Complete(), TrainablePolicy) == []


@pytest.mark.parametrize("member", [m for m in contract_members(TrainablePolicy) if m != "sft_loss"])
def test_a_class_lacking_a_member_fails_the_trainable_check_naming_it(member):
    """(sft_loss is on every Policy: the base raises 'not trainable'.)"""
    from wamkit.train.config import TrainConfig
    from wamkit.train.trainer import resolve_io

    pol = _without(member)
    assert not isinstance(pol, TrainablePolicy)
    assert missing_members(pol, TrainablePolicy) == [member]
    with pytest.raises(UserError, match=rf"not trainable \(missing {member}\)"):
        resolve_io(TrainConfig(), pol)


@pytest.mark.parametrize("member", contract_members(ExportablePolicy))
def test_a_class_lacking_a_member_cannot_be_exported_naming_it(member, tmp_path):
    from wamkit.policies.export import save_exported

    with pytest.raises(UserError, match=f"has no `{member}`"):
        save_exported(_without(member), tmp_path / "x")


def test_a_registered_non_trainable_policy_names_every_missing_member():
    from wamkit.train.config import TrainConfig
    from wamkit.train.trainer import resolve_io

    with pytest.raises(UserError, match="'zero' is not trainable \\(missing action_pipeline, module, export_config, "
                                        "fsdp_units, lr_multipliers\\)"):
        resolve_io(TrainConfig(), make_policy("zero"))


def test_init_after_sharding_is_a_class_check():
    assert issubclass(policy_class("wam-ref"), InitAfterSharding)
    assert not issubclass(policy_class("cosmos3"), InitAfterSharding)
    assert not issubclass(_Complete, InitAfterSharding)
