"""renderer=shared, the parent side: the render processes (render_server.py) that draw every env's frames, one GL
context each, and how an env process finds its own.

- `RenderService(gl, processes)`: N spawned render processes, each listening on a Unix socket in a private
  directory (mode 0700) with a random key (a 0600 file beside the sockets; the env side reads it there, so it never
  travels in configs or results). A watchdog thread restarts a process that dies, on the same socket: clients
  reconnect and ask again (render requests are stateless), so a crash loses no frame.
- `shared_service(gl, processes)`: one service per (GL selection, count) in this process, closed at exit.
- `resolve_renderer(kwargs, gl, index)`: an env's kwargs with renderer=shared made concrete, `unix:<socket>` of
  the render process for env `index` (envs spread over the processes); EnvWorker.start does it in the parent
  (render_backend.worker_kwargs), an env built in this process does it itself.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from wamkit.core.config import check_number
from wamkit.core.errors import ConfigError

RENDERERS = ("own", "shared")      # renderer: own (each env process renders in its own GL contexts) | shared
ADDRESS_PREFIX = "unix:"           # a concrete renderer value: unix:<socket of a render process>
KEY_FILE = "key"                   # beside the sockets
START_TIMEOUT_S = 60.0
WATCH_S = 0.2


def check_renderer(renderer: Any, processes: Any) -> None:
    ok = renderer in RENDERERS or (isinstance(renderer, str) and renderer.startswith(ADDRESS_PREFIX))
    if not ok:
        raise ConfigError(f"renderer must be one of {', '.join(RENDERERS)} (or {ADDRESS_PREFIX}<socket>), "
                          f"got {renderer!r}")
    check_number("render_processes", processes, lo=1)


def key_for(address: str) -> bytes:
    """The key of the service whose socket is `address` (read from the file beside it)."""
    return (Path(address).parent / KEY_FILE).read_bytes().strip()


class RenderService:
    def __init__(self, gl: dict[str, str | None], processes: int = 1):
        self.gl, self.n = dict(gl), int(processes)
        self.dir = Path(tempfile.mkdtemp(prefix="wamkit-render-"))   # mkdtemp: mode 0700
        self.key = secrets.token_hex(32).encode()
        keyfile = self.dir / KEY_FILE
        keyfile.write_bytes(self.key)
        keyfile.chmod(0o600)
        self.addresses = [str(self.dir / f"render-{i}.sock") for i in range(self.n)]
        self._procs: list = [None] * self.n
        self.restarts = 0
        self._closed = threading.Event()
        self._lock = threading.Lock()
        for i in range(self.n):
            self._start(i)
        self._watch = threading.Thread(target=self._watchdog, name="render-watchdog", daemon=True)
        self._watch.start()

    def address(self, index: int) -> str:
        return self.addresses[int(index) % self.n]

    def pids(self) -> list[int | None]:
        return [p.pid if p is not None else None for p in self._procs]

    def _start(self, i: int) -> None:
        import multiprocessing as mp

        from wamkit.envs.process_setup import single_threaded_children
        from wamkit.envs.render_server import serve

        with self._lock:
            if self._closed.is_set():
                return
            addr = self.addresses[i]
            Path(addr).unlink(missing_ok=True)
            ctx = mp.get_context("spawn")
            ready_r, ready_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=serve, args=(addr, self.key, self.gl, ready_w), name=f"wamkit-render-{i}",
                            daemon=True)
            with single_threaded_children():
                p.start()
            ready_w.close()
            if not ready_r.poll(START_TIMEOUT_S):
                p.kill()
                raise RuntimeError(f"render process {i} did not start within {START_TIMEOUT_S:.0f} s")
            try:
                ready_r.recv()
            except EOFError:
                raise RuntimeError(f"render process {i} exited while starting (exit code {p.exitcode}); "
                                   f"GL: {self.gl}") from None
            self._procs[i] = p

    def _watchdog(self) -> None:
        while not self._closed.wait(WATCH_S):
            for i, p in enumerate(self._procs):
                if p is not None and not p.is_alive() and not self._closed.is_set():
                    p.join(0)
                    self.restarts += 1
                    try:
                        self._start(i)
                    except RuntimeError:
                        time.sleep(1.0)   # try again at the next turn

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for p in self._procs:
                if p is not None and p.is_alive():
                    p.kill()
                if p is not None:
                    p.join(5.0)
            self._procs = [None] * self.n
        shutil.rmtree(self.dir, ignore_errors=True)


_services: dict[tuple, RenderService] = {}
_services_lock = threading.Lock()


def shared_service(gl: dict[str, str | None], processes: int = 1) -> RenderService:
    key = (tuple(sorted(gl.items())), int(processes))
    with _services_lock:
        svc = _services.get(key)
        if svc is None:
            svc = _services[key] = RenderService(gl, processes)
        return svc


def close_services() -> None:
    with _services_lock:
        for svc in _services.values():
            svc.close()
        _services.clear()


atexit.register(close_services)


def current_gl() -> dict[str, str | None]:
    from wamkit.envs.process_setup import GL_VARS

    return {k: os.environ.get(k) for k in GL_VARS}


def resolve_renderer(kwargs: dict, gl: dict[str, str | None] | None, index: int) -> dict:
    """kwargs with renderer=shared replaced by the address of env `index`'s render process (started on first use,
    rendering with `gl`: the variables the env would render with; None: this process's)."""
    if kwargs.get("renderer") != "shared":
        return kwargs
    processes = kwargs.get("render_processes", 1)
    try:
        processes = int(processes)
    except (TypeError, ValueError):
        pass   # check_renderer names it
    check_renderer("shared", processes)
    svc = shared_service(current_gl() if gl is None else gl, processes)
    return {**kwargs, "renderer": ADDRESS_PREFIX + svc.address(index)}
