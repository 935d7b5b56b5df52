"""runtime=ray under faults: bad settings and addresses fail in seconds with one line, Ray's start-up leaves nothing
behind when it fails or is interrupted, SIGTERM ends a Ray run like a local one, and a server actor that dies is
replaced behind a URL that answers (and is counted, and its log copied to OUT).

The fast tests stand in a fake `ray.init`; the slow ones (marked ray) run one private local Ray at a time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wamkit.core.errors import ConfigError, UserError

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# options and start-up (no Ray cluster)


@pytest.mark.parametrize("key,value", [
    ("num_cpus_per_env", "abc"), ("startup_timeout_s", "nan"), ("memory_gb_per_env", "inf"),
    ("startup_timeout_s", 0), ("num_cpus", 0), ("num_gpus_per_server", float("nan")),
    ("copy_obs", "maybe"), ("log_to_driver", "maybe"),
])
def test_every_ray_value_is_checked_before_ray_starts(key, value):
    from wamkit.runtime.ray_session import RayOptions

    with pytest.raises(ConfigError, match=f"ray.{key}"):
        RayOptions.from_any({key: value})


def test_an_env_bundle_needs_a_resource():
    from wamkit.runtime.ray_session import RayOptions

    with pytest.raises(ConfigError, match="ray.num_cpus_per_env and ray.memory_gb_per_env"):
        RayOptions.from_any({"num_cpus_per_env": 0, "memory_gb_per_env": 0})
    o = RayOptions.from_any({"num_cpus": "2", "copy_obs": "false", "startup_timeout_s": "30"})
    assert (o.num_cpus, o.copy_obs, o.startup_timeout_s) == (2, False, 30.0)


def test_ray_not_installed_is_one_line(monkeypatch):
    import importlib.util

    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.runtime import eval_runtime

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    cfg = load_config(EvalConfig, None, ["runtime=ray"])
    with pytest.raises(UserError, match=r"runtime=ray needs Ray: pip install 'wamkit\[ray\]'"):
        eval_runtime(cfg)


@pytest.fixture
def no_ray_started(monkeypatch, tmp_path):
    """Ray not initialized here; temp dirs under tmp_path; the auth refresh (Ray's C++ config) left alone."""
    from wamkit.runtime import ray_session

    if ray.is_initialized():
        pytest.skip("a Ray is already initialized in this process")
    monkeypatch.setattr(ray_session, "_session", None)
    monkeypatch.setattr(ray_session, "_refresh_ray_auth_config", lambda: None)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for k in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path


def test_wrong_address_fails_in_seconds(no_ray_started, monkeypatch):
    from wamkit.runtime import ray_session

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]              # closed again: nothing listens there
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init must not run for a dead address"))
    with pytest.raises(UserError, match=f"nothing answers at 127.0.0.1:{port}"):
        ray_session.acquire({"address": f"127.0.0.1:{port}"})
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")        # what address=auto connects to
    with pytest.raises(UserError, match=f"Ray at auto \\(RAY_ADDRESS=127.0.0.1:{port}\\): nothing answers"):
        ray_session.acquire({"address": "auto"})


def test_explicit_address_sends_the_token(no_ray_started, monkeypatch):
    """Ray turns token mode on by itself only for address=auto; the auth failure is named even when wrapped."""
    from ray.exceptions import AuthenticationError

    from wamkit.runtime import ray_session

    seen = {}

    def init(**kw):
        seen["mode"] = os.environ.get("RAY_AUTH_MODE")
        try:
            raise AuthenticationError("InvalidAuthToken: token missing or incorrect")
        except AuthenticationError as e:
            raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1") from e

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x" * 32)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with pytest.raises(UserError, match="RAY_AUTH_TOKEN=<token>"):
            ray_session.acquire({"address": f"127.0.0.1:{srv.getsockname()[1]}"})
    assert seen["mode"] == "token"
    assert "RAY_AUTH_MODE" not in os.environ          # the environment is restored


def test_private_ray_ignores_ray_address_and_cleans_up(no_ray_started, monkeypatch):
    from wamkit.runtime import ray_session

    seen, shut = {}, []

    def init(**kw):
        seen["address"] = os.environ.get("RAY_ADDRESS")
        raise ConnectionError("No node info found matching attributes")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(1))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6399")
    with pytest.raises(UserError, match="could not start a local Ray: No node info"):
        ray_session.acquire({})
    assert seen["address"] is None and os.environ["RAY_ADDRESS"] == "127.0.0.1:6399"
    assert not list(no_ray_started.glob("wkray-*")) and shut
    assert "RAY_TMPDIR" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ


def test_ctrl_c_during_ray_init_leaves_nothing(no_ray_started, monkeypatch):
    from wamkit.runtime import ray_session

    shut = []

    def init(**kw):
        os.makedirs(kw["_temp_dir"])                  # Ray had started writing its session
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(1))
    with pytest.raises(KeyboardInterrupt):
        ray_session.acquire({})
    assert shut and not list(no_ray_started.glob("wkray-*"))
    assert "RAY_TMPDIR" not in os.environ and ray_session.current() is None


def test_ray_init_keeps_our_sigterm_handler(monkeypatch):
    from wamkit.runtime import ray_session

    def init(**kw):                                     # what ray.init does
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    def ours(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", init)
    old = signal.signal(signal.SIGTERM, ours)
    try:
        ray_session._init_ray()
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, old)


def test_stale_temp_dirs_of_dead_drivers_are_removed(tmp_path):
    from wamkit.core.shm_names import process_start
    from wamkit.runtime.ray_session import OWNER_FILE, remove_stale_temp_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    parent = os.getppid()
    dirs = {"wkray-dead": f"{dead.pid} 1", "wkray-reused": f"{parent} 1",            # start time does not match
            "wkray-alive": f"{parent} {process_start(parent)}", "wkray-mine": f"{os.getpid()} -",
            "wkray-nofile": None, "other-dead": f"{dead.pid} 1"}
    for name, owner in dirs.items():
        (tmp_path / name / "ray").mkdir(parents=True)
        if owner:
            (tmp_path / name / OWNER_FILE).write_text(owner)
    removed = {Path(p).name for p in remove_stale_temp_dirs(str(tmp_path))}
    assert removed == {"wkray-dead", "wkray-reused"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-dead", "wkray-alive", "wkray-mine", "wkray-nofile"]


def test_actor_error_is_the_original_exception():
    from ray.exceptions import RayTaskError

    from wamkit.runtime.ray_runtime import _actor_error
    from wamkit.serve.workers import ServerConfigError

    cause = ServerConfigError("the server on port 1 did not start: host=10.0.0.1 is not a loopback address")
    e = RayTaskError("wait_healthy", "\x1b[36mray::_ServerActorImpl.wait_healthy()\x1b[39m\nTraceback ...", cause)
    assert _actor_error(e) is cause
    assert str(_actor_error(RayTaskError("f", "first line\nTraceback ...", None))) == "first line"
    assert "\x1b" not in str(_actor_error(ValueError("\x1b[36mray::x\x1b[39m\nmore")))


# ---------------------------------------------------------------------------------------------------------------
# a real eval under Ray, SIGTERMed (its own private Ray, in a subprocess: runs before the fixture below starts one)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.metaworld
def test_sigterm_of_a_ray_eval_exits_like_a_local_one(tmp_path):
    pytest.importorskip("metaworld")
    if ray.is_initialized():
        pytest.skip("a Ray is already initialized in this process")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "LP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "wamkit.cli.main", "eval", "env=metaworld", "env_args.tasks=reach-v3", "trials=20",
           "policy=fixed-cost", "policy_args.base_ms=100", "max_steps=40", "image_size=32", "num_envs=1",
           "progress=false", "runtime=ray", "ray.num_cpus=2", "ray.memory_gb_per_env=0.5", f"out={out}"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        journal = out / "results.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (journal.exists() and journal.read_text().strip()):
            assert p.poll() is None, p.communicate()
            time.sleep(0.2)
        assert journal.read_text().strip(), "no episode finished"   # Ray is up and its actors run
        p.send_signal(signal.SIGTERM)
        _, stderr = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 143, stderr
    assert "wamkit eval: terminated (SIGTERM); workers stopped" in stderr
    assert "SIGTERM received" not in stderr and "Traceback" not in stderr, stderr


# ---------------------------------------------------------------------------------------------------------------
# action-server actors on a private local Ray


@pytest.fixture(scope="module")
def private_ray():
    from wamkit.runtime import ray_session

    if ray.is_initialized():
        pytest.skip("a Ray is already initialized in this process")
    saved = os.environ.pop("RAY_ADDRESS", None)
    s = ray_session.acquire({"num_cpus": 2})
    try:
        yield s
    finally:
        ray_session.release(s)
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
    assert not ray.is_initialized()


def _serve_pids(actor_pid: int) -> list[int]:
    """The `wamkit serve` process(es) an actor started (they carry parent_pid=<actor pid>)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and f"parent_pid={actor_pid}".encode() in cmd:
            pids.append(int(d.name))
    return pids


def _wait_unhealthy(w, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while w.healthy() and time.time() < deadline:
        time.sleep(0.3)
    assert not w.healthy()


@pytest.mark.slow
@pytest.mark.ray
def test_server_actor_killed_is_replaced_behind_an_answering_url(private_ray, tmp_path):
    import httpx

    from wamkit.runtime.ray_runtime import RayServerWorker

    log = tmp_path / "server-0.log"
    w = RayServerWorker({"policy": "random", "policy_args": {"action_dim": 4, "horizon": 3}, "log_path": log},
                        {"num_gpus_per_server": 0, "num_cpus_per_server": 0, "startup_timeout_s": 120})
    try:
        w.start().wait_healthy(120)
        url0, info0 = w.url, ray.get(w.actor.info.remote())
        w.kill()                                       # the actor dies; its server follows (parent_pid watch)
        _wait_unhealthy(w)
        assert w.ensure_healthy(120) is True
        assert httpx.get(w.url + "/health", timeout=5).status_code == 200     # the URL clients re-read answers
        assert w.url == url0                           # same node: the replacement took the old port
        assert w.starts == 2
        info1 = ray.get(w.actor.info.remote())
        assert info1["pid"] != info0["pid"]
        # the server process dies inside a live actor: restarted in place, and counted (summary's server_restarts)
        for pid in _serve_pids(info1["pid"]):
            os.kill(pid, signal.SIGKILL)
        _wait_unhealthy(w)
        assert w.ensure_healthy(120) is True and w.url == url0 and w.starts == 3
        assert w.ensure_healthy(120) is False
    finally:
        w.stop()
    assert info1["log_path"].startswith(private_ray.temp_dir)     # in Ray's session logs, not loose in /tmp
    assert not Path(info1["log_path"]).exists()       # the node's log file goes at stop()...
    assert "=== start" in log.read_text()            # ...its tail is in OUT/server-<i>.log


@pytest.mark.slow
@pytest.mark.ray
def test_server_needing_a_gpu_on_a_cpu_only_ray_is_one_line(private_ray):
    from wamkit.runtime.ray_runtime import RayServerWorker

    if ray.cluster_resources().get("GPU", 0) >= 1:
        pytest.skip("this machine has a GPU")
    w = RayServerWorker({"policy": "random"}, {"num_gpus_per_server": 1, "startup_timeout_s": 60})
    try:   # refused before placement (not after startup_timeout_s): the pre-check's line, which names no wait
        with pytest.raises(UserError, match=r"ray.num_gpus_per_server=1 but the cluster has GPU=0") as e:
            w.start()
        assert "within" not in str(e.value)
    finally:
        w.stop()
