from dataclasses import dataclass, field

import pytest

from wamkit.core.config import load_config, to_dict
from wamkit.core.errors import ConfigError
from wamkit.eval.config import EvalConfig


def test_overrides_are_typed():
    cfg = load_config(EvalConfig, None, ["suite=libero_goal", "tasks=0,3", "trials=2", "run_to_max_steps=true",
                                         "policy_args.size=tiny", "server.port=8123", "mode=auto", "num_envs=3"])
    assert cfg.suite == "libero_goal" and cfg.tasks == [0, 3] and cfg.trials == 2
    assert cfg.run_to_max_steps is True and cfg.policy_args == {"size": "tiny"}
    assert cfg.server.port == 8123 and cfg.num_envs == 3


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(EvalConfig, None, ["suit=libero_goal"])
    assert "'suit'" in str(e.value) and "suite" in str(e.value)


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="trials"):
        load_config(EvalConfig, None, ["trials=many"])
    with pytest.raises(ConfigError, match="mode"):
        load_config(EvalConfig, None, ["mode=fast"])
    with pytest.raises(ConfigError, match="server.nope"):
        load_config(EvalConfig, None, ["server.nope=1"])


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("suite: libero_10\ntrials: 5\nserver:\n  max_batch_size: 8\n")
    cfg = load_config(EvalConfig, p, ["trials=7"])
    assert (cfg.suite, cfg.trials, cfg.server.max_batch_size) == ("libero_10", 7, 8)
    assert to_dict(cfg)["server"]["max_batch_size"] == 8


def test_serial_keeps_the_other_keys():
    # bench eval derives its rows from one base config: serial must not rewrite num_envs/request_size/pipelines
    cfg = load_config(EvalConfig, None, ["mode=serial", "num_envs=4", "request_size=8"])
    assert (cfg.num_envs, cfg.request_size) == (4, 8)


def test_renamed_keys_still_load_with_one_warning_and_both_spellings_are_refused():
    import warnings

    from wamkit.core import config as C

    C._warned_renames.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = load_config(EvalConfig, None, ["batch=4", "max_batch=16"])
        b = load_config(EvalConfig, None, ["batch=2"])
    assert (a.request_size, a.max_request_size, b.request_size) == (4, 16, 2)
    msgs = [str(x.message) for x in w if issubclass(x.category, FutureWarning)]
    assert len(msgs) == 2 and any("'batch' is now 'request_size'" in m for m in msgs)   # once per key
    with pytest.raises(ConfigError, match="both given"):
        load_config(EvalConfig, None, ["batch=4", "request_size=4"])
    # the same for a policy's options: wam-ref's old `max_batch`
    from wamkit.policies.registry import make_policy

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert make_policy("fixed-cost", max_batch=8).max_batch_size() == 8


def test_optional_and_nested_defaults():
    @dataclass
    class Inner:
        a: int = 1

    @dataclass
    class Outer:
        x: int | None = 3
        inner: Inner = field(default_factory=Inner)

    assert load_config(Outer, None, ["x=none"]).x is None
    assert load_config(Outer, None, ["inner.a=5"]).inner.a == 5


def test_server_replicas_validated():
    from wamkit.eval.config import EvalConfig

    cfg = load_config(EvalConfig, None, ["server.replicas=3", "server.gpus=0,1"])
    assert (cfg.server.replicas, cfg.server.gpus) == (3, [0, 1])
    with pytest.raises(ConfigError, match="server.replicas"):
        load_config(EvalConfig, None, ["server.replicas=0"])
    with pytest.raises(ConfigError, match="server.port"):
        load_config(EvalConfig, None, ["server.replicas=2", "server.port=8000"])


def test_field_docs_from_comments_continuations_and_metadata():
    from typing import Literal

    from wamkit.core.config import config_keys

    @dataclass
    class C:
        # a section header, not a field's meaning
        a: int = 1                  # first line
                                    # second line
        b: Literal["x", "y"] = "x"  # pick one
        c: str = field(default="s", metadata={"help": "from metadata"})  # overridden comment
        d: list[str] = field(default_factory=lambda: ["p", "q"])

    rows = {k: (tp, d, m) for k, tp, d, m in config_keys(C)}
    assert rows["a"] == ("int", "1", "first line second line")
    assert rows["b"] == ("x|y", "x", "pick one")
    assert rows["c"][2] == "from metadata"
    assert rows["d"] == ("list[str]", "p,q", "")
