"""Server workers: launch an action server process, health-check it, stop it; never leave one behind.

    with WamkitServerWorker("fixed-cost", {"base_ms": 20}, max_batch_size=16) as w:   # started and healthy
        client = ActionClient(w.url)
        ...
    # stopped: SIGTERM to its process group, wait, SIGKILL

- Each server runs in its own process group (start_new_session) so stop() also reaches its children.
- Every started process is registered with weakref.finalize: it is stopped when the worker is garbage-collected and at
  interpreter exit. A wamkit server additionally watches our pid (parent_pid=) and exits if we die.
- port=0 picks a free loopback port; if another process takes it before our server binds it, wait_healthy() picks
  another and starts again (only before the server was first healthy); restart() keeps it, so the url stays valid.
- Output goes to a log file (`log_path`); wait_healthy() quotes its tail when the server dies or times out.
- A server that exits or does not answer in time raises ServerStartError, a RunError: the CLI prints one line (the
  last line of the server's log, usually its error, and the log's path) and exits 1.
- The policy travels to a `wamkit serve` child as a name it can resolve: a name registered with register_policy in
  this process only becomes its `package.module:Class`, and the directories that class was imported from go on the
  child's PYTHONPATH (it also starts in this process's working directory), so a custom policy imports there too.
- Identity: a wamkit server gets a fresh random instance id per start (env WAMKIT_INSTANCE_ID, not argv) and its
  /health echoes it. healthy() counts only an answer carrying it; wait_healthy() raises ServerIdentityError (a
  UserError: one line, exit 2) at once when a healthy answer carries another id or none: the port is held by another
  server, which must never be scored in place of ours. A server that exits with code 2 (its own user error, e.g. the
  port is in use) raises ServerConfigError (also a UserError) quoting its last log line.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

import httpx

from wamkit.core.cpu_pinning import change_pin, pin_process, pinnable_env
from wamkit.core.errors import RunError, UserError
from wamkit.core.lifecycle import StartStopContext
from wamkit.serve.config import INSTANCE_ENV, TOKEN_ENV, http_url


logger = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4 * 2**20    # the most of a log's end log_tail reads (a Ray server actor's stop() returns that much)


class ServerStartError(RunError, RuntimeError):
    """The server process exited or did not become healthy in time: one line (the CLI prints it, exit 1) naming the
    last line of the server's log and where the log is."""


class ServerIdentityError(ServerStartError, UserError):
    """The port answers, but not as the server this worker started (another or no instance id)."""


class ServerConfigError(ServerStartError, UserError):
    """The server process refused its configuration (exit code 2: a port in use, a bad key)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (IPv4 or IPv6: server.host=::1 was a gaierror from an AF_INET socket)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def _stop_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM to the process group, wait up to `timeout`, then SIGKILL; reap the leader."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    if proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever is left of the group (the leader if it ignored SIGTERM, or its children)
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


class ServerWorker(StartStopContext, abc.ABC):
    """A server process: start(), wait_healthy(timeout), url, healthy(), stop(), restart(), ensure_healthy(); a
    context manager (the `wamkit.serve.contracts.ServerWorkerLike` contract)."""

    health_path = "/health"
    default_start_timeout = 60.0
    instance_id: str | None = None   # set per start by servers that echo it in /health; None: no identity check

    def __init__(self, port: int = 0, host: str = "127.0.0.1", log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, stop_timeout: float = 10.0):
        self.host = host
        self.port = int(port) or free_port(host)
        self.auto_port = not int(port)   # picked here: may be re-picked if taken before the server binds it
        self._port_repicks = 0
        self._was_healthy = False
        self.env = dict(env or {})
        self.stop_timeout = float(stop_timeout)
        self._own_log = log_path is None   # a temporary log: removed by a `with` block that ends without error
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"wamkit-server-{self.port}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self.starts = 0
        self.cpus: list[int] | None = None   # CPUs the server process is pinned to at every start (None: not pinned)
        self.pinnable = False   # may be pinned while it runs (set_cpus later): started with PINNABLE_ENV (cpu_pinning)
        self._started_pinnable = False

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The command line that runs the server."""

    def child_env(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        return pinnable_env(env) if self.cpus or self.pinnable else env

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def set_cpus(self, cpus: list[int] | None) -> None:
        """Pin the server process (now, if it runs, and at every start) to `cpus`; None: not pinned (a running
        process pinned before goes back to every CPU this one may use). Processes it started itself before this
        call (a policy_process child) keep their set. A running process not started pinnable (nor pinned) is
        warned about: its OpenMP threads may spin against each other on fewer CPUs (core/cpu_pinning.py)."""
        if cpus and self.running() and not self._started_pinnable:
            logger.warning(
                "server %s is pinned to %d CPU(s) while it runs, but was not started pinnable (OMP_WAIT_POLICY="
                "PASSIVE): its OpenMP threads may spin against each other; set pinnable before start", self.url,
                len(cpus))
        self.cpus = change_pin(self.proc.pid if self.running() else None, self.cpus, cpus)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "ServerWorker":
        if self.running():
            return self
        log = open(self.log_path, "ab")
        try:
            log.write(f"\n=== start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.child_env(), start_new_session=True, close_fds=True)
            self._started_pinnable = bool(self.cpus or self.pinnable)
        finally:
            log.close()
        if self.cpus:   # before the interpreter starts any thread: every later thread and child inherits the set
            pin_process(self.proc.pid, self.cpus)
        self._finalizer = weakref.finalize(self, _stop_group, self.proc, self.stop_timeout)
        self.starts += 1
        return self

    def _probe(self, timeout: float) -> tuple[bool, bool]:
        """(answered 200, the answer is from our server): GET health_path, check its instance_id."""
        try:
            r = httpx.get(self.url + self.health_path, timeout=timeout)
        except httpx.HTTPError:
            return False, False
        if r.status_code != 200:
            return False, False
        if self.instance_id is None:
            return True, True
        try:
            ours = r.json().get("instance_id") == self.instance_id
        except (ValueError, AttributeError):
            ours = False
        return True, ours

    def healthy(self, timeout: float = 2.0) -> bool:
        if not self.running():
            return False
        ok, ours = self._probe(timeout)
        return ok and ours

    def wait_healthy(self, timeout: float | None = None, poll_s: float = 0.2) -> "ServerWorker":
        timeout = self.default_start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None:
                raise ServerStartError("server was not started")
            rc = self.proc.poll()
            if rc == 2 and self.instance_id is not None:   # a wamkit CLI user error: its one line says why
                last = (self.log_tail(1) or "").strip() or f"exit code 2 (log {self.log_path})"
                if "already in use" in last and self._repick_port():
                    continue
                raise ServerConfigError(f"the server on port {self.port} did not start: {last}")
            if rc is not None:
                raise ServerStartError(f"the server on port {self.port} exited with code {rc} before becoming "
                                       f"healthy: {self.last_log_line()} (its log: {self.log_path})")
            ok, ours = self._probe(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            if ok and not ours:
                if self._repick_port():
                    continue
                raise ServerIdentityError(
                    f"port {self.port} on {self.host} is held by another server (its {self.health_path} does not "
                    f"carry the instance id of the server started here); choose another port, or port 0 for a free "
                    f"one")
            if ok and self.running():
                self._was_healthy = True
                return self
            if time.monotonic() >= deadline:
                raise ServerStartError(f"server not healthy after {timeout:.0f}s at {self.url}; its log ends: "
                                       f"{self.last_log_line()} (its log: {self.log_path})")
            time.sleep(poll_s)

    def _repick_port(self) -> bool:
        """A port this worker picked itself was taken by someone else before our server bound it: stop ours, pick a
        new free port, start again (a few times at most). False for a port the caller chose: that is their error."""
        if not self.auto_port or self._was_healthy or self._port_repicks >= 3:
            return False
        self._port_repicks += 1
        self.stop()
        self.port = free_port(self.host)
        self.start()
        return True

    def stop(self) -> None:
        """SIGTERM to the process group (in-flight work finishes), wait, then SIGKILL."""
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_group once and unregisters it
            self._finalizer = None

    def _release(self, failed: bool) -> None:
        """Leaving `with worker:`: stop; the temporary log this worker made goes too, unless the block failed (the
        log says why)."""
        self.stop()
        if self._own_log and not failed:
            self.log_path.unlink(missing_ok=True)

    def restart(self, timeout: float | None = None) -> "ServerWorker":
        self.stop()
        self.start()
        return self.wait_healthy(timeout)

    def ensure_healthy(self, timeout: float | None = None) -> bool:
        """Restart the server if its process died or stopped answering; True if a restart happened."""
        if self.running() and self.healthy():
            return False
        self.restart(timeout)
        return True

    def last_log_line(self) -> str:
        """The line of the log's end that says most: the last of a traceback (the exception) or of a one-line
        error, else the last non-empty line ('the log is empty')."""
        lines = [ln.strip() for ln in (self.log_tail(60) or "").splitlines() if ln.strip()]
        lines = [ln for ln in lines if not ln.startswith("=== start ")]
        return lines[-1][:500] if lines else "the log is empty"

    def log_tail(self, n: int | None = 40, max_bytes: int = LOG_TAIL_BYTES, whole_log: str | None = None) -> str:
        """The end of the server's log: its last `n` lines (None: all) of its last `max_bytes`; with n=None, a log
        longer than that starts with a line saying how much was cut, and where the whole log is (`whole_log`: what
        to say instead of its path, for a caller that removes the file)."""
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - max_bytes))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        if n is not None:
            return "\n".join(text.splitlines()[-n:])
        if size > max_bytes:
            text = f"[... {size - max_bytes} bytes cut; {whole_log or self.log_path}]\n" + text
        return text

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, pid={self.pid}, running={self.running()})"


def _kv_args(d: dict[str, Any] | Sequence[str] | None, prefix: str = "") -> list[str]:
    if d is None:
        return []
    if isinstance(d, dict):
        return [f"{prefix}{k}={v}" for k, v in d.items()]
    return list(d)


class WamkitServerWorker(ServerWorker):
    """`python -m wamkit.cli.main serve policy=... port=...` as a subprocess. The token travels in the environment
    (WAMKIT_TOKEN), not on the command line."""

    def __init__(self, policy: str = "random", policy_args: dict[str, Any] | None = None, port: int = 0,
                 max_batch_size: int = 0, max_wait_ms: float = 5.0, token: str | None = None,
                 extra_args: dict[str, Any] | Sequence[str] | None = None, host: str = "127.0.0.1",
                 python: str | None = None, log_path: str | Path | None = None, env: dict[str, str] | None = None,
                 stop_timeout: float = 10.0):
        super().__init__(port=port, host=host, log_path=log_path, env=env, stop_timeout=stop_timeout)
        from wamkit.policies.catalog import policy_target

        # a name registered in this process only: the child resolves its `package.module:Class` instead
        self.policy, self.policy_args = policy_target(str(policy)), dict(policy_args or {})
        self.max_batch_size, self.max_wait_ms = int(max_batch_size), float(max_wait_ms)
        self.token, self.extra_args = token, extra_args
        self.python = python or sys.executable

    def start(self) -> "WamkitServerWorker":
        if not self.running():
            self.instance_id = secrets.token_hex(16)   # fresh per process: a stale answer can never pass
        super().start()
        return self

    def child_env(self) -> dict[str, str]:
        env = super().child_env()
        env.pop(TOKEN_ENV, None)
        if self.token:
            env[TOKEN_ENV] = self.token
        env[INSTANCE_ENV] = self.instance_id or ""
        env.setdefault("PYTHONUNBUFFERED", "1")
        roots = self.import_roots()
        if roots:   # a custom policy's modules: importable in the child as they are here
            have = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in have if p not in roots])
        return env

    def import_roots(self) -> list[str]:
        """The directories the policy's class was imported from here, where it is `package.module:Class` (given, or
        named by an export directory's manifest); [] for wamkit's own policies."""
        from wamkit.policies.catalog import import_roots, is_import_target
        from wamkit.policies.manifest import is_export_dir, read_export_manifest

        target = self.policy
        try:
            if is_export_dir(target):
                target = read_export_manifest(target).policy
            return import_roots(target) if is_import_target(target) else []
        except UserError:   # not importable here: the child says why (one line, exit 2)
            return []

    def command(self) -> list[str]:
        return [self.python, "-m", "wamkit.cli.main", "serve", f"policy={self.policy}", f"host={self.host}",
                f"port={self.port}", f"max_batch_size={self.max_batch_size}", f"max_wait_ms={self.max_wait_ms}",
                f"parent_pid={os.getpid()}", *_kv_args(self.policy_args, "policy_args."), *_kv_args(self.extra_args)]


class SGLangServerWorker(ServerWorker):
    """`sglang serve --model-type diffusion ... --batching-mode dynamic` (GPU only). Model loads can take minutes."""

    default_start_timeout = 900.0

    def __init__(self, model_path: str, port: int = 0, batching_max_size: int = 16, batching_delay_ms: float = 5.0,
                 attention_backend: str = "fa", extra_args: Sequence[str] | None = None, host: str = "127.0.0.1",
                 sglang_bin: str = "sglang", log_path: str | Path | None = None, env: dict[str, str] | None = None,
                 stop_timeout: float = 30.0, action_stats_path: str | None = None):
        super().__init__(port=port, host=host, log_path=log_path, env=env, stop_timeout=stop_timeout)
        self.model_path = str(model_path)
        self.batching_max_size, self.batching_delay_ms = int(batching_max_size), batching_delay_ms
        self.attention_backend, self.extra_args, self.sglang_bin = attention_backend, list(extra_args or []), sglang_bin
        # SGLang reads action stats from its pipeline config (a server-side file; no per-request field): a partial
        # pipeline-config JSON holding only action_stats_path updates that one field. With it, SGLang returns
        # denormalized actions (the client must then not denormalize again).
        self.action_stats_path = None if action_stats_path is None else str(action_stats_path)
        self.pipeline_config_path: Path | None = None
        if self.action_stats_path is not None:
            self.pipeline_config_path = self.log_path.with_suffix(".pipeline.json")
            self.pipeline_config_path.write_text(json.dumps({"action_stats_path": self.action_stats_path}))

    def command(self) -> list[str]:
        d = self.batching_delay_ms
        d = int(d) if float(d).is_integer() else d
        stats = [] if self.pipeline_config_path is None else ["--pipeline-config-path", str(self.pipeline_config_path)]
        return [self.sglang_bin, "serve", "--model-path", self.model_path, "--model-type", "diffusion",
                "--host", self.host, "--port", str(self.port), "--attention-backend", self.attention_backend,
                "--batching-mode", "dynamic", "--batching-max-size", str(self.batching_max_size),
                "--batching-delay-ms", str(d), *stats, *self.extra_args]

    def has_action_api(self, timeout: float = 5.0) -> bool:
        """Released SGLang versions may lack the action endpoint: probe GET /v1/actions/metadata."""
        try:
            return httpx.get(self.url + "/v1/actions/metadata", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False
