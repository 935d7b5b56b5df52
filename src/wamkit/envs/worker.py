"""EnvWorker: one simulator per spawned process, driven from the parent (asyncio or blocking).

Data path: commands and small metadata (state vector, task text, flags) go through a Pipe; camera images come back
through one preallocated shared-memory buffer per worker (cameras x image_size^2 x 3 bytes), which the parent copies
out before returning, so the buffer is reused by the next call. Per-step video frames (render_every_step, the rare
path) travel through the pipe.

Many workers can be in flight at once from one event loop: `await reset/execute` registers the pipe and the process
sentinel with `loop.add_reader` and never blocks the loop. A process that dies mid-call (killed, OOM, segfault in the
simulator) raises EnvWorkerCrashed promptly, because its end of the pipe and its sentinel both become readable.
A process that stops answering (stalled, SIGSTOP) is detected by the caller's deadline (the eval scheduler's
CallDeadlines), which kill()s it and handles EnvWorkerTimeout, a kind of EnvWorkerCrashed, as a crash; an env that
is not built within start_timeout raises EnvWorkerTimeout too.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import time
import traceback
import weakref
from multiprocessing import shared_memory
from multiprocessing.connection import wait as mp_wait

import numpy as np

from wamkit.core.cpu_pinning import change_nice, change_pin, pin_process, renice_process
from wamkit.core.lifecycle import StartClosingContext
from wamkit.core.shm_names import owned_name, sweep_orphans
from wamkit.core.types import ChunkResult, Observation
from wamkit.envs.base import EnvSpec, TaskInfo, timed_execute
from wamkit.envs.process_setup import single_threaded_children


class EnvWorkerCrashed(RuntimeError):
    """The env worker process died (or could not start). exit_code: the dead process's exit status (negative: the
    signal that ended it), where a death was seen; None where it was not (the env raised while being built, no
    answer within a deadline, a Ray actor lost)."""

    def __init__(self, index: int, msg: str, exit_code: int | None = None):
        super().__init__(f"env worker {index} crashed: {msg}")
        self.index, self.msg, self.exit_code = index, msg, exit_code


def exit_text(code: int | None) -> str:
    """`exit code -9 (SIGKILL)`: a process's exit status, with the signal's name where a signal ended it."""
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class EnvWorkerTimeout(EnvWorkerCrashed):
    """The env worker did not answer within its deadline (stalled, e.g. SIGSTOP or a hung simulator); the process
    has been (or is about to be) killed, so it is handled exactly like a crash: restart, re-run the episode."""

    def __init__(self, index: int, msg: str):
        super().__init__(index, msg)


class EnvWorkerError(RuntimeError):
    """The env raised inside the worker process (the process is still alive); carries the remote traceback."""

    def __init__(self, index: int, exc_type: str, msg: str, tb: str):
        super().__init__(f"env worker {index}: {exc_type}: {msg}\n--- remote traceback ---\n{tb}")
        self.index, self.exc_type, self.remote_traceback = index, exc_type, tb


# ---------------------------------------------------------------------------------------------------------------
# child side

def _image_layout(spec: EnvSpec) -> tuple[dict[str, tuple[int, tuple[int, int, int]]], int]:
    s = int(spec.image_size)
    shape = (s, s, 3)
    per = s * s * 3
    return {cam: (k * per, shape) for k, cam in enumerate(spec.cameras)}, max(1, per * len(spec.cameras))


def _pack_obs(obs: Observation | None, layout, buf: np.ndarray | None):
    if obs is None:
        return None
    meta = {"state": obs.state, "task": obs.task, "shm": [], "inline": {}}
    for cam, img in obs.images.items():
        slot = layout.get(cam)
        if buf is not None and slot is not None and tuple(img.shape) == slot[1] and img.dtype == np.uint8:
            off, shape = slot
            buf[off: off + img.size] = img.reshape(-1)
            meta["shm"].append(cam)
        else:  # unexpected size: correctness first, through the pipe
            meta["inline"][cam] = img
    return meta


def _worker_main(conn, env_name: str, env_kwargs: dict, index: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    from wamkit.envs.process_setup import setup_headless_gl

    setup_headless_gl()
    shm = None
    env = None
    try:
        from wamkit.envs.base import make_env
        from wamkit.envs.render_backend import in_use

        env = make_env(env_name, **env_kwargs)
        layout, nbytes = _image_layout(env.spec)
        conn.send(("ready", env.spec, env.tasks(), nbytes, in_use(type(env), env)))
        kind, name = conn.recv()
        assert kind == "shm"
        shm = shared_memory.SharedMemory(name=name)
        buf = np.ndarray((shm.size,), np.uint8, buffer=shm.buf)
    except BaseException as e:  # noqa: BLE001 - report why we could not start, then exit
        try:
            conn.send(("err", type(e).__name__, str(e), traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        if env is not None:
            env.close()
        return
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            cmd = msg[0]
            if cmd == "close":
                break
            try:
                if cmd == "reset":
                    obs = env.reset(msg[1], msg[2])
                    conn.send(("ok", _pack_obs(obs, layout, buf)))
                elif cmd == "execute":
                    t0 = time.perf_counter()
                    r = timed_execute(env, msg[1], render_every_step=msg[2], run_to_max_steps=msg[3])
                    reply = {"obs": _pack_obs(r.obs, layout, buf), "success": bool(r.success), "done": bool(r.done),
                             "steps": int(r.steps), "episode_steps": int(r.episode_steps), "frames": r.frames,
                             "worker_cpu_s": r.worker_cpu_s, "worker_render_s": r.worker_render_s}
                    reply["worker_s"] = time.perf_counter() - t0
                    conn.send(("ok", reply))
                elif cmd == "ping":
                    conn.send(("ok", os.getpid()))
                else:
                    conn.send(("err", "ValueError", f"unknown command {cmd!r}", ""))
            except Exception as e:  # noqa: BLE001 - the env failed, the worker lives on
                conn.send(("err", type(e).__name__, str(e), traceback.format_exc()))
    finally:
        try:
            env.close()
        finally:
            del buf
            shm.close()


# ---------------------------------------------------------------------------------------------------------------
# parent side

_LIVE: "weakref.WeakSet[EnvWorker]" = weakref.WeakSet()
SHM_PREFIX = "wamkit-env-"   # the image buffers' names in /dev/shm (core.shm_names: pid-tagged, swept)


@atexit.register
def _close_all() -> None:
    for w in list(_LIVE):
        try:
            w.close(timeout=2.0)
        except Exception:  # noqa: BLE001
            pass


class EnvWorker(StartClosingContext):
    """One env in its own spawned process (the `wamkit.envs.contracts.EnvWorkerLike` contract). Not safe for
    concurrent calls on the same worker (one call at a time); many workers may be driven concurrently from one asyncio
    loop."""

    def __init__(self, env: str, env_kwargs: dict | None = None, index: int = 0, start_timeout: float = 300.0):
        self.env_name, self.env_kwargs, self.index = env, dict(env_kwargs or {}), int(index)
        self.start_timeout = float(start_timeout)
        self.spec: EnvSpec | None = None
        self.tasks: list[TaskInfo] = []
        self._proc = None
        self._conn = None
        self._shm: shared_memory.SharedMemory | None = None
        self._buf: np.ndarray | None = None
        self._layout: dict = {}
        self._busy = False
        self.loaded_task: int | None = None   # task of the last successful reset (None: no scene built)
        self.load_s: float | None = None      # seconds the last reset to another task (a scene load) took
        self.render: dict | None = None       # what MuJoCo renders with in the process (render_backend.in_use)
        self.cpus: list[int] | None = None    # CPUs the process is pinned to (set_cpus; None: not pinned)
        self.nice = 0                         # niceness of the process (set_nice; 0: as started, this process's)
        self._stale = False  # a cancelled call's reply is still on its way: drain it before the next call

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> "EnvWorker":
        """Spawn the process and block until its env is built (spec and tasks known)."""
        if self.alive:
            return self
        import multiprocessing as mp

        from wamkit.envs.base import env_class
        from wamkit.envs.render_backend import worker_kwargs

        # render_backend=auto resolved here, once
        kwargs = worker_kwargs(env_class(self.env_name), self.env_kwargs, self.index)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker_main, args=(child, self.env_name, kwargs, self.index),
                           name=f"wamkit-env-{self.index}", daemon=True)
        with single_threaded_children():
            proc.start()
        if self.cpus:   # before the simulator starts its threads: they inherit the set
            pin_process(proc.pid, self.cpus)
        if self.nice:   # likewise: later threads inherit the niceness
            renice_process(proc.pid, self.nice)
        child.close()  # so that the child's death shows as EOF on our end
        self._proc, self._conn = proc, parent
        _LIVE.add(self)
        try:
            msg = self._recv_blocking(self.start_timeout)
        except TimeoutError:
            self._teardown(kill=True)
            raise EnvWorkerTimeout(self.index, f"env {self.env_name!r} not built within {self.start_timeout:.0f} s "
                                               f"(start_timeout)") from None
        except EnvWorkerCrashed as e:   # the process died before its env was built (killed, OOM, segfault)
            self._teardown(kill=True)
            raise EnvWorkerCrashed(self.index, f"process died while building env {self.env_name!r} "
                                               f"({exit_text(e.exit_code)})", e.exit_code) from None
        except BaseException:
            self._teardown(kill=True)
            raise
        if msg[0] == "err":
            self._teardown(kill=True)
            raise EnvWorkerCrashed(self.index, f"could not build env {self.env_name!r}: {msg[1]}: {msg[2]}\n{msg[3]}")
        _, spec, tasks, nbytes, self.render = msg
        self.spec, self.tasks = spec, list(tasks)
        self._layout, _ = _image_layout(spec)
        sweep_orphans(SHM_PREFIX)    # image buffers of evaluations killed before they could unlink theirs
        self._shm = shared_memory.SharedMemory(name=owned_name(SHM_PREFIX), create=True, size=int(nbytes))
        self._buf = np.ndarray((self._shm.size,), np.uint8, buffer=self._shm.buf)
        self._conn.send(("shm", self._shm.name))
        return self

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def set_cpus(self, cpus: list[int] | None) -> None:
        """Pin the process (now, if it runs, and at every restart) to `cpus`; None: not pinned (a running process
        pinned before goes back to every CPU this one may use)."""
        self.cpus = change_pin(self._proc.pid if self.alive else None, self.cpus, cpus)

    def set_nice(self, nice: int) -> None:
        """Run the process (now, if it runs, and at every restart) at niceness `nice`; 0: as started (a running
        process reniced before goes back to this process's niceness, which needs privileges: renice_process)."""
        self.nice = change_nice(self._proc.pid if self.alive else None, self.nice, nice)

    def kill(self) -> None:
        """SIGKILL the process (for tests and hung simulators); the next or in-flight call raises EnvWorkerCrashed."""
        if self._proc is not None and self._proc.pid is not None and self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)

    def restart(self) -> "EnvWorker":
        self._teardown(kill=True)
        return self.start()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the env to close, wait for the process, then free the shared memory. Idempotent."""
        if self._proc is not None and self._proc.is_alive() and self._conn is not None and not self._busy:
            try:
                self._conn.send(("close",))
                self._proc.join(timeout)
            except (OSError, BrokenPipeError):
                pass
        self._teardown(kill=True)

    def _teardown(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.is_alive() and kill:
                proc.kill()
            proc.join(5.0)
            try:
                proc.close()
            except ValueError:
                pass
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._buf = None
        if self._shm is not None:
            try:
                self._shm.close()
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self._shm = None
        self._busy = self._stale = False
        self.loaded_task = None
        _LIVE.discard(self)

    # ---- calls ---------------------------------------------------------------------------------------------------
    def reset_sync(self, task_id: int, trial: int) -> Observation:
        t0 = time.monotonic()
        obs = self._unpack_obs(self._call_sync(("reset", int(task_id), int(trial))))
        self._reset_done(int(task_id), time.monotonic() - t0)
        return obs

    def execute_sync(self, actions, render_every_step: bool = False, run_to_max_steps: bool = False) -> ChunkResult:
        msg = ("execute", np.asarray(actions, np.float32), bool(render_every_step), bool(run_to_max_steps))
        return self._unpack_chunk(self._call_sync(msg))

    async def reset(self, task_id: int, trial: int) -> Observation:
        t0 = time.monotonic()
        obs = self._unpack_obs(await self._call_async(("reset", int(task_id), int(trial))))
        self._reset_done(int(task_id), time.monotonic() - t0)
        return obs

    def _reset_done(self, task_id: int, seconds: float) -> None:
        if self.loaded_task != task_id:
            self.load_s = seconds
        self.loaded_task = task_id   # the scene the process has built (schedulers keep an env on its task)

    async def execute(self, actions, render_every_step: bool = False, run_to_max_steps: bool = False) -> ChunkResult:
        msg = ("execute", np.asarray(actions, np.float32), bool(render_every_step), bool(run_to_max_steps))
        return self._unpack_chunk(await self._call_async(msg))

    # ---- plumbing ------------------------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        if self._proc is None or self._conn is None:
            raise EnvWorkerCrashed(self.index, "not started (or closed); call start() or restart()")
        if self._busy:
            raise RuntimeError(f"env worker {self.index} already has a call in flight")
        if not self._proc.is_alive():
            code = self._proc.exitcode
            raise EnvWorkerCrashed(self.index, f"process is dead ({exit_text(code)})", code)
        if self._stale:
            self._stale = False
            self._busy = True
            self._recv_blocking(None)  # the reply of the cancelled call (or the crash it ended in)
            self._busy = False
        try:
            self._conn.send(msg)
        except (OSError, BrokenPipeError) as e:
            raise EnvWorkerCrashed(self.index, f"send failed: {e}") from e
        self._busy = True

    def _read_reply(self):
        """The reply is (or should be) ready: read it, or diagnose the death."""
        try:
            if self._conn.poll():
                return self._conn.recv()
        except (EOFError, OSError):
            pass
        code = None
        if self._proc is not None:
            self._proc.join(1.0)
            code = self._proc.exitcode
        self._busy = False
        raise EnvWorkerCrashed(self.index, f"process died mid-call ({exit_text(code)})", code)

    def _recv_blocking(self, timeout: float | None):
        ready = mp_wait([self._conn, self._proc.sentinel], timeout)
        if not ready:
            raise TimeoutError(f"env worker {self.index}: no reply within {timeout} s")
        return self._read_reply()

    def _finish(self, msg):
        self._busy = False
        if msg[0] == "err":
            raise EnvWorkerError(self.index, msg[1], msg[2], msg[3])
        return msg[1]

    def _call_sync(self, msg):
        self._send(msg)
        return self._finish(self._recv_blocking(None))

    async def _call_async(self, msg):
        self._send(msg)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fds = (self._conn.fileno(), self._proc.sentinel)

        def on_ready():
            if not fut.done():
                fut.set_result(None)

        for fd in fds:
            loop.add_reader(fd, on_ready)
        try:
            await fut
        except asyncio.CancelledError:
            self._busy, self._stale = False, True
            raise
        finally:
            for fd in fds:
                loop.remove_reader(fd)
        return self._finish(self._read_reply())

    def _unpack_obs(self, meta) -> Observation | None:
        if meta is None:
            return None
        images = {}
        for cam in meta["shm"]:
            off, shape = self._layout[cam]
            n = shape[0] * shape[1] * shape[2]
            images[cam] = self._buf[off: off + n].reshape(shape).copy()  # copy out: the buffer is reused
        images.update(meta["inline"])
        return Observation(images=images, state=meta["state"], task=meta["task"])

    def _unpack_chunk(self, d) -> ChunkResult:
        return ChunkResult(obs=self._unpack_obs(d["obs"]), success=d["success"], done=d["done"], steps=d["steps"],
                           episode_steps=d["episode_steps"], frames=list(d["frames"]), worker_s=d.get("worker_s"),
                           worker_cpu_s=d.get("worker_cpu_s"), worker_render_s=d.get("worker_render_s"))
