"""Connecting to Ray, or starting a private local Ray, and shutting down exactly what we started.

    session = acquire(opts)   # connect to opts.address, or start a local Ray in a temp dir (once per process)
    ...                       # create actors, placement groups
    release(session)          # the last holder out shuts down the Ray we started (and removes its temp dir)

Rules
- `address` given ("auto", "ray://...", "host:6379"): connect to that cluster; it is never shut down by us. A
  host:port (or ray://host:port) that nothing answers at fails in seconds (a TCP connect first: ray.init itself
  retries for minutes). With a token configured and RAY_AUTH_MODE unset, token mode is set for an explicit address
  (Ray 2.60 does so only for "auto") until the session ends.
- no `address` and Ray not initialized: start a local Ray with a fresh temp dir (RAY_TMPDIR points there, so the
  address file and session logs stay inside it), no dashboard UI, no metrics agent (enable_metrics_collection off),
  node address 127.0.0.1 with every Ray listener bound to it (LOOPBACK_ENV; token auth guards the gRPC ones against
  other local users), `num_cpus` from the options if given. RAY_ADDRESS in
  the environment is ignored (with a warning; ray.address=auto uses it). Shut down when the last holder releases
  it, or at exit; a failed or interrupted start removes what it made, and the temp dirs of drivers that died
  (SIGKILL) are removed at the next start.
- ray.init keeps this process's SIGTERM handler (wamkit's: the run unwinds, exit 143).
- Ray already initialized by the caller (tests, notebooks): used as is, never shut down by us.
- Token auth stays on. Connecting needs the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
  ~/.ray/auth_token). For a local Ray we start and no token configured anywhere, an ephemeral random token is put in
  this process's environment (inherited by the Ray processes we start), so nothing is written to the home dir.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wamkit.core.config import build_options, check_number
from wamkit.core.errors import ConfigError, UserError
from wamkit.core.shm_names import owner_gone, process_start

log = logging.getLogger(__name__)

PLACEMENTS = ("spread", "pack", "strict_spread", "strict_pack")
CONNECT_CHECK_S = 5.0     # a TCP connect to ray.address's port, before ray.init (which retries for minutes)


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
    num_cpus: int | float | None = None  # local Ray only: CPUs it may use (None: all; a whole number, 2.0 is 2)
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
        """The options from a dict of `ray.*` keys (CLI strings or YAML values), by core.config's rules: an unknown
        key or a bad value is one ConfigError naming `ray.<key>`, before Ray starts."""
        if isinstance(value, RayOptions):
            return value
        return build_options(cls, dict(value or {}), kind="ray", name="runtime=ray")

    def validate(self) -> None:
        """Normalizes and range-checks, through build_options (which puts `ray.` before a message's bare key): a bad
        value would otherwise surface as a traceback, or after Ray started and waited for a placement that can
        never come."""
        if self.address is not None:
            self.address = self.address.strip()
            if self.address.lower() in ("", "none", "null", "local"):
                self.address = None
        self.placement = self.placement.lower()
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"unknown ray.placement {self.placement!r}; valid choices: {', '.join(PLACEMENTS)}")
        for k in ("num_cpus_per_env", "memory_gb_per_env", "num_gpus_per_server", "num_cpus_per_server",
                  "memory_gb_per_server"):
            check_number(k, getattr(self, k), lo=0)
        check_number("startup_timeout_s", self.startup_timeout_s, lo=0, lo_open=True)
        check_number("num_cpus", self.num_cpus, lo=1, none_ok=True)
        if self.num_cpus is not None:
            if not float(self.num_cpus).is_integer():
                raise ConfigError(f"num_cpus must be a whole number of CPUs, got {self.num_cpus!r}")
            self.num_cpus = int(self.num_cpus)
        if self.num_cpus_per_env == 0 and self.memory_gb_per_env == 0:   # Ray refuses an all-zero bundle
            raise ConfigError("ray.num_cpus_per_env and ray.memory_gb_per_env are both 0: an env worker's bundle needs "
                              "at least one non-zero resource")

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


def _unsetenv(s: RaySession, k: str) -> None:
    if k not in s.env_backup:
        s.env_backup[k] = os.environ.get(k)
    os.environ.pop(k, None)


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
            _session = _connect(opts)
        else:
            _session = _start_private(opts)
        try:
            _session.driver_ip = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001
            pass
        _session.holders += 1
        return _session


def _connect(opts: RayOptions) -> RaySession:
    """ray.init(address=...) to an existing cluster: fail in seconds with one line when nothing answers there."""
    s = RaySession(started_here=False, address=opts.address, temp_dir=None)
    target = label = opts.address
    if opts.address == "auto" and os.environ.get("RAY_ADDRESS"):   # what ray.init connects to for auto
        target = os.environ["RAY_ADDRESS"]
        label = f"auto (RAY_ADDRESS={target})"
    _check_reachable(target, label)
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        log.warning("RAY_AUTH_MODE=disabled: connecting without token authentication")
    elif os.environ.get("RAY_AUTH_MODE") is None and _token_configured():
        # Ray 2.60 turns token mode on by itself only for a cluster it finds (auto, no RAY_ADDRESS): an explicit
        # host:port would send no token, and the cluster refuse us. Restored when the session ends.
        _setenv(s, "RAY_AUTH_MODE", "token")
        _refresh_ray_auth_config()
    try:
        _init_ray(address=opts.address, namespace=opts.namespace, log_to_driver=opts.log_to_driver,
                  logging_level=logging.WARNING)
    except BaseException as e:
        _restore_env(s)
        _refresh_ray_auth_config()
        if not isinstance(e, Exception):
            raise
        raise UserError(_connect_error(opts.address, e)) from None
    return s


def _connect_error(address: str, e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if _auth_error(e):
        return (f"cannot connect to Ray at {address}: {first}. Give this process the cluster's token: "
                "RAY_AUTH_TOKEN=<token> or RAY_AUTH_TOKEN_PATH=<file> (on the head: `ray get-auth-token`)")
    return f"cannot connect to Ray at {address}: {first}"


def _auth_error(e: BaseException | None) -> bool:
    """An authentication failure anywhere in the exception chain (Ray wraps it in a ConnectionError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if "auth" in type(e).__name__.lower() or "token" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of 'host:port' or 'ray://host[:port]' (Ray client's default port 10001); None for 'auto'."""
    a = address.strip()
    default = None
    if a.startswith("ray://"):
        a, default = a[len("ray://"):].split("/")[0], 10001
    elif "://" in a or a == "auto":
        return None
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit():
        return (a.strip("[]"), default) if default and a else None
    return host.strip("[]") or "127.0.0.1", int(port)


def _check_reachable(address: str, label: str, timeout: float = CONNECT_CHECK_S) -> None:
    """A TCP connect to the cluster's port first: Ray itself retries a dead address for minutes."""
    hp = _host_port(address)
    if hp is None:
        return
    try:
        socket.create_connection(hp, timeout=timeout).close()
    except OSError as e:
        raise UserError(f"cannot connect to Ray at {label}: nothing answers at {hp[0]}:{hp[1]} within "
                        f"{timeout:g} s ({e.strerror or type(e).__name__}); check ray.address (the head's "
                        "`ray start --head` prints it), or ray.address=auto on a cluster node") from None


def _start_private(opts: RayOptions) -> RaySession:
    """A local Ray in a fresh temp dir, for this process only; any failure (Ctrl-C too) leaves nothing behind."""
    import ray

    remove_stale_temp_dirs()
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX)       # short: Ray's unix socket paths live under it
    s = RaySession(started_here=True, address=None, temp_dir=tmp)
    _write_owner(tmp)
    _setenv(s, "RAY_TMPDIR", tmp)
    if os.environ.get("RAY_ADDRESS"):
        # no ray.address means a private Ray (docs/ray.md); ray.init would otherwise connect to RAY_ADDRESS
        log.warning("RAY_ADDRESS=%s ignored: no ray.address given, so a private local Ray is started (give "
                    "ray.address=auto to use that cluster)", os.environ["RAY_ADDRESS"])
        _unsetenv(s, "RAY_ADDRESS")
    if os.environ.get("RAY_AUTH_MODE") is None:
        _setenv(s, "RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"].lower() == "token" and not _token_configured():
        _setenv(s, "RAY_AUTH_TOKEN", secrets.token_hex(32))   # ephemeral, never written to disk by us
    _refresh_ray_auth_config()
    _setenv(s, LOOPBACK_ENV, "0")   # read by every Ray process we start: each binds 127.0.0.1 only
    try:
        with _loopback_node():
            _init_ray(num_cpus=opts.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                      _temp_dir=os.path.join(tmp, "ray"), namespace=opts.namespace,
                      _system_config={"enable_metrics_collection": False},
                      log_to_driver=opts.log_to_driver, logging_level=logging.WARNING)
    except BaseException as e:   # KeyboardInterrupt too: whatever ray.init started goes
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        _restore_env(s)
        _refresh_ray_auth_config()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ConnectionError):
            first = (str(e).strip().splitlines() or ["ConnectionError"])[0]
            raise UserError(f"could not start a local Ray: {first}") from None
        raise
    return s


# Ray's switch for a single-node Ray (its default on macOS and Windows): "0" makes the node's address 127.0.0.1, which
# ray.init's own _node_ip_address="127.0.0.1" does not (Ray 2.60 swaps a loopback address for the host's routable
# one), and then every Ray server binds it: GCS, raylet, object manager, core workers' gRPC, the dashboard agent's
# HTTP and gRPC, the runtime-env agent, the Prometheus endpoints of the dashboard head and the autoscaler monitor
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_node():
    """While ray.init starts a private Ray: this process's Ray reads LOOPBACK_ENV when it is imported, which may
    have been before we set it (a test, a notebook, the CLI's own import): its copy follows the variable meanwhile."""
    try:
        from ray._private import ray_constants
    except ImportError:   # another Ray layout: the environment variable alone
        yield
        return
    old = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old


def _init_ray(**kwargs: Any) -> None:
    """ray.init, keeping this process's SIGTERM handling: ray.init installs a handler that exits with code 15 (and
    Ray's C++ failure handler prints a stack dump); wamkit's own handler unwinds the run (exit 143). A Python-level
    re-install also takes SIGTERM back from the C++ handler (sigaction), so no dump."""
    import ray

    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**kwargs)
    finally:
        if main:
            after = signal.getsignal(signal.SIGTERM)
            # ours if one was set (wamkit CLI), else Ray's own Python handler: sys.exit runs atexit (shutdown)
            handler = before if callable(before) else after
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)


# ---- leftovers of drivers that died without cleaning up (SIGKILL, a crash during start-up)

TEMP_PREFIX = "wkray-"
OWNER_FILE = "wamkit-owner"    # in each temp dir we create: '<pid> <process start time>' of the driver


def _write_owner(tmp: str) -> None:
    Path(tmp, OWNER_FILE).write_text(f"{os.getpid()} {process_start(os.getpid()) or '-'}\n")


def _creator_dead(d: Path) -> bool:
    """True only when we are sure: our owner file names a process that is gone (core.shm_names.owner_gone)."""
    try:
        pid_s, start = Path(d, OWNER_FILE).read_text().split()[:2]
        pid = int(pid_s)
    except (OSError, ValueError):
        return False
    return owner_gone(pid, None if start == "-" else start)


def remove_stale_temp_dirs(root: str | None = None) -> list[str]:
    """Remove the wkray-* temp dirs (ours: the owner file) of drivers that died (a SIGKILL leaves them)."""
    removed = []
    try:
        entries = list(Path(root or tempfile.gettempdir()).glob(TEMP_PREFIX + "*"))
    except OSError:
        return removed
    for d in entries:
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid() or not _creator_dead(d):
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    if removed:
        log.info("removed %d Ray temp dir(s) of dead wamkit runs: %s", len(removed), ", ".join(removed))
    return removed


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

    if not s.started_here:
        if s.env_backup:   # the RAY_AUTH_MODE set for connecting
            _restore_env(s)
        return
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
