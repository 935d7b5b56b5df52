"""Connecting to Ray, or starting a private local Ray, and shutting down exactly what we started.

    session = acquire(opts)   # connect to opts.address, or start a local Ray in a temp dir (once per process)
    ...                       # create actors, placement groups
    release(session)          # the last holder out shuts down the Ray we started (and removes its temp dir)

Rules
- `address` given ("auto", "ray://...", "host:6379"): connect to that cluster; it is never shut down by us.
- no `address` and Ray not initialized: start a local Ray with a fresh temp dir (RAY_TMPDIR points there, so the
  address file and session logs stay inside it), no dashboard UI, node address 127.0.0.1 (Ray 2.60's own agents still
  listen on wildcard gRPC ports: token auth guards them), `num_cpus` from the options if given. Shut down when the last holder releases it, or at exit.
- Ray already initialized by the caller (tests, notebooks): used as is, never shut down by us.
- Token auth stays on. Connecting needs the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
  ~/.ray/auth_token). For a local Ray we start and no token configured anywhere, an ephemeral random token is put in
  this process's environment (inherited by the Ray processes we start), so nothing is written to the home dir.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from wamkit.core.errors import ConfigError, UserError

log = logging.getLogger(__name__)

PLACEMENTS = ("spread", "pack", "strict_spread", "strict_pack")


@dataclass
class RayOptions:
    """The `ray.*` keys of `wamkit eval ... runtime=ray` (a free-form dict in EvalConfig, validated here)."""

    address: str | None = None          # None: start a private local Ray; "auto" or "<host>:<port>": connect
    num_cpus_per_env: float = 1.0       # CPU request of one env actor
    memory_gb_per_env: float = 2.5      # memory request of one env actor (LIBERO: ~2.5 GB; MetaWorld: ~0.3 GB)
    placement: str = "spread"           # env actors' placement group: spread | pack | strict_spread | strict_pack
    num_gpus_per_server: float = 1.0    # GPU request of one action-server actor (0 on CPU-only clusters)
    num_cpus_per_server: float = 1.0
    memory_gb_per_server: float = 0.0   # 0: no memory request
    server_host: str | None = None      # None: 127.0.0.1 on the driver's host, else the node's IP
    num_cpus: int | None = None         # local Ray only: CPUs it may use (None: all)
    namespace: str = "wamkit"
    startup_timeout_s: float = 300.0    # placement group ready + actor built + env constructed
    copy_obs: bool = True               # copy images out of the object store (writable, as the local worker's);
                                        # false: zero-copy read-only views (pin object-store memory while held)
    forward_env: list[str] = field(default_factory=lambda: ["MUJOCO_GL", "PYOPENGL_PLATFORM", "LP_NUM_THREADS",
                                                            "WAMKIT_CACHE_DIR", "LIBERO_CONFIG_PATH",
                                                            "WAMKIT_MUJOCO_GL_SET"])   # envs.process_setup.GL_SET_MARK
    log_to_driver: bool = False         # actors' stdout/stderr on the driver console (else in the session logs)

    @classmethod
    def from_any(cls, value: Any) -> "RayOptions":
        if isinstance(value, RayOptions):
            return value
        value = dict(value or {})
        names = {f.name for f in fields(cls)}
        bad = sorted(set(value) - names)
        if bad:
            raise ConfigError(f"unknown key ray.{bad[0]}; valid keys: " + ", ".join(f"ray.{n}" for n in sorted(names)))
        o = cls(**value)
        if o.address in ("", "none", "null", "local"):
            o.address = None
        if isinstance(o.forward_env, str):
            o.forward_env = [s for s in o.forward_env.split(",") if s]
        o.placement = str(o.placement).lower()
        if o.placement not in PLACEMENTS:
            raise ConfigError(f"unknown ray.placement {o.placement!r}; valid choices: {', '.join(PLACEMENTS)}")
        for k in ("num_cpus_per_env", "memory_gb_per_env", "num_gpus_per_server", "num_cpus_per_server",
                  "memory_gb_per_server"):
            v = float(getattr(o, k))
            if v < 0:
                raise ConfigError(f"ray.{k} must be >= 0")
            setattr(o, k, v)
        return o

    def runtime_env(self) -> dict[str, Any]:
        env = {k: os.environ[k] for k in self.forward_env if k in os.environ}
        return {"env_vars": env} if env else {}


@dataclass
class RaySession:
    started_here: bool
    address: str | None
    temp_dir: str | None
    holders: int = 0
    driver_ip: str = "127.0.0.1"
    env_backup: dict[str, str | None] = field(default_factory=dict)


_lock = threading.RLock()
_session: RaySession | None = None


def _token_configured() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return True
    return (Path.home() / ".ray" / "auth_token").exists()


def _setenv(s: RaySession, k: str, v: str) -> None:
    if k not in s.env_backup:
        s.env_backup[k] = os.environ.get(k)
    os.environ[k] = v


def acquire(opts: RayOptions | dict | None = None) -> RaySession:
    """Make sure this process is connected to Ray (see the module doc); count one more holder."""
    global _session
    import ray

    opts = RayOptions.from_any(opts)
    with _lock:
        if _session is not None and ray.is_initialized():
            _session.holders += 1
            return _session
        if ray.is_initialized():          # the caller's own Ray: never ours to shut down
            _session = RaySession(started_here=False, address=None, temp_dir=None)
        elif opts.address:
            if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
                log.warning("RAY_AUTH_MODE=disabled: connecting without token authentication")
            try:
                ray.init(address=opts.address, namespace=opts.namespace, log_to_driver=opts.log_to_driver,
                         logging_level=logging.WARNING)
            except Exception as e:  # noqa: BLE001
                if "auth" in type(e).__name__.lower() or "token" in str(e).lower():
                    raise UserError(f"cannot connect to Ray at {opts.address}: {e}. Give this process the cluster's "
                                    "token: RAY_AUTH_TOKEN=<token> or RAY_AUTH_TOKEN_PATH=<file> (on the head: "
                                    "`ray get-auth-token`)") from None
                raise UserError(f"cannot connect to Ray at {opts.address}: {e}") from None
            _session = RaySession(started_here=False, address=opts.address, temp_dir=None)
        else:
            tmp = tempfile.mkdtemp(prefix="wkray-")       # short: Ray's unix socket paths live under it
            s = RaySession(started_here=True, address=None, temp_dir=tmp)
            _setenv(s, "RAY_TMPDIR", tmp)
            if os.environ.get("RAY_AUTH_MODE") is None:
                _setenv(s, "RAY_AUTH_MODE", "token")
            if os.environ["RAY_AUTH_MODE"].lower() == "token" and not _token_configured():
                _setenv(s, "RAY_AUTH_TOKEN", secrets.token_hex(32))   # ephemeral, never written to disk by us
            _refresh_ray_auth_config()
            try:
                ray.init(num_cpus=opts.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                         _temp_dir=os.path.join(tmp, "ray"), namespace=opts.namespace,
                         log_to_driver=opts.log_to_driver, logging_level=logging.WARNING)
            except Exception:
                _restore_env(s)
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _session = s
        try:
            _session.driver_ip = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001
            pass
        _session.holders += 1
        return _session


def _refresh_ray_auth_config() -> None:
    """Ray's C++ config reads RAY_AUTH_MODE once; make it see what we just set (as ray.init does itself)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except Exception:  # noqa: BLE001 - older/newer Ray: ray.init reports auth problems itself
        log.debug("could not refresh Ray's auth config", exc_info=True)


def _restore_env(s: RaySession) -> None:
    for k, v in s.env_backup.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    s.env_backup.clear()


def release(session: RaySession | None = None) -> None:
    """One holder fewer; the last one out shuts down a Ray we started (and removes its temp dir)."""
    global _session
    with _lock:
        s = _session
        if s is None or (session is not None and session is not s):
            return
        s.holders -= 1
        if s.holders > 0:
            return
        _session = None
        _shutdown(s)


def _shutdown(s: RaySession) -> None:
    import ray

    if s.started_here:
        try:
            ray.shutdown()
        finally:
            _restore_env(s)
            if s.temp_dir:
                shutil.rmtree(s.temp_dir, ignore_errors=True)


@atexit.register
def _at_exit() -> None:
    global _session
    with _lock:
        s, _session = _session, None
    if s is not None:
        try:
            _shutdown(s)
        except Exception:  # noqa: BLE001
            pass


def current() -> RaySession | None:
    return _session
