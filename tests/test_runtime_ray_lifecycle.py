"""The Ray session: options validation (fast), and a private local Ray started and shut down by us (slow)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from wamkit.core.errors import ConfigError
from wamkit.runtime.ray_session import RayOptions
from processes import is_loopback, listeners


def test_ray_options_validation():
    o = RayOptions.from_any({"address": "auto", "placement": "PACK", "num_cpus_per_env": "2"})
    assert o.address == "auto" and o.placement == "pack" and o.num_cpus_per_env == 2.0
    assert RayOptions.from_any({"address": "local"}).address is None
    assert RayOptions.from_any(None).placement == "spread"
    with pytest.raises(ConfigError, match="ray.placment"):
        RayOptions.from_any({"placment": "spread"})
    with pytest.raises(ConfigError, match="valid choices"):
        RayOptions.from_any({"placement": "diagonal"})
    with pytest.raises(ConfigError, match=">= 0"):
        RayOptions.from_any({"memory_gb_per_env": -1})


def test_ray_keys_through_eval_config():
    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig

    cfg = load_config(EvalConfig, None, ["runtime=ray", "ray.address=auto", "ray.num_cpus_per_env=1",
                                         "ray.memory_gb_per_env=2.5", "ray.placement=pack"])
    o = RayOptions.from_any(cfg.ray)
    assert (o.address, o.num_cpus_per_env, o.memory_gb_per_env, o.placement) == ("auto", 1.0, 2.5, "pack")


def _procs_mentioning(text: str) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{d.name}: {cmd[:160]}")
    return out


@pytest.mark.slow
@pytest.mark.ray
def test_private_local_ray_started_and_shut_down(monkeypatch):
    ray = pytest.importorskip("ray")
    from wamkit.runtime import ray_session

    if ray.is_initialized():
        pytest.skip("a Ray is already initialized in this process")
    for k in ("RAY_TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"wk-home-{os.getpid()}"))
    home = Path(os.environ["HOME"])
    s1 = ray_session.acquire({"num_cpus": 1})
    try:
        s2 = ray_session.acquire({})
        assert s2 is s1 and s1.started_here and s1.holders == 2
        tmp = s1.temp_dir
        assert tmp and Path(tmp).is_dir()
        assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ.get("RAY_AUTH_TOKEN")
        assert not (home / ".ray" / "auth_token").exists()          # ephemeral token, nothing written to HOME
        pids = {int(p.split(":")[0]) for p in _procs_mentioning(tmp)}
        assert pids, "no Ray processes found under our temp dir"
        # Ray 2.60 still runs its dashboard head (state API) with include_dashboard=False: no HTTP dashboard port
        # (8265); every listener is on loopback (tests/test_secrets_s33.py checks that of the driver's descendants)
        held = listeners(pids)
        assert not [x for x in held if x[2] == 8265] and all(is_loopback(addr) for _, addr, _ in held), held
        assert ray.get(ray.remote(lambda: 7).remote()) == 7
        ray_session.release(s2)
        assert ray.is_initialized()                                   # one holder left
    finally:
        ray_session.release(s1)
    assert not ray.is_initialized()
    assert "RAY_AUTH_TOKEN" not in os.environ and "RAY_TMPDIR" not in os.environ
    deadline = time.time() + 20
    while (left := _procs_mentioning(tmp)) and time.time() < deadline:
        time.sleep(0.5)
    assert left == []
    assert not Path(tmp).exists()
