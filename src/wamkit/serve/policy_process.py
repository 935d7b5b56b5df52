"""PolicyProcess: the served policy in a process of its own (`wamkit serve policy_process=true`), so the server's event
loop (HTTP, decoding, batching, responses) and the policy's host-side work never share one GIL.

Why: in one process, a CUDA policy's predict thread holds the GIL while it launches kernels (and while a launch waits
for room in a full launch queue, inside the driver, where Python cannot switch threads), so the event loop decodes the
next requests only in the gaps: they trickle into the batcher and batches stay small. Here the event loop's process
does no policy work at all, and the policy process's GIL belongs to predict.

- The child is started with multiprocessing's spawn context, builds the policy with make_policy(name, **kwargs) and
  answers over one Pipe: ("predict", arena, layout, seeds) -> actions, ("warmup", n) -> seconds per step, ("close",).
- Arrays travel through shared memory: the parent copies each batch's images and states into one memory-mapped file
  in /dev/shm (grown when a batch needs more; the child unlinks it as soon as it has mapped it, before it predicts,
  and the parent after the reply should the child have failed first; a file left by a server killed in between
  carries the server's pid in its name and is removed by the next policy process started) and sends only their layout (offsets, shapes, dtypes, task texts); the child hands the policy views of it, valid
  for that call. 64 observations of two 256 px cameras: one 25 MB memcpy instead of pickling them through the pipe
  (~10 vs ~90 ms on a 2-core CPU).
- Errors: a failing build raises here (UserError stays UserError: `wamkit serve` exits 2 with its line); a failing
  predict raises RuntimeError with the child's message (the server answers 500 and keeps serving), UserError where the
  policy refused its input (422); a child that died
  raises RuntimeError on every call.
- The child ignores SIGINT/SIGTERM (a server worker signals the whole process group; the parent flushes its queued
  batches first) and exits when the parent closes the pipe or dies (EOF).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
from typing import Any, Sequence

import numpy as np

from wamkit.core.cpu_pinning import torch_threads as resolved_threads
from wamkit.core.errors import UserError
from wamkit.core.heap import freeze_heap
from wamkit.core.shm_names import SHM_DIR, owned_name, sweep_orphans
from wamkit.core.types import Observation
from wamkit.policies.base import Policy

ARENA_PREFIX = "wamkit-policy-"   # + the server's pid (core.shm_names.owned_name)


class _Arena:
    """The parent's shared-memory file for batch arrays (module doc)."""

    def __init__(self):
        self.mm: mmap.mmap | None = None
        self.path: str | None = None        # set until the child has mapped it, then unlinked
        self.size = 0

    def pack(self, observations: Sequence[Observation]) -> tuple[str | None, list]:
        """Copy the arrays in; (path of a new file for the child to map, or None; layout per observation)."""
        arrays, layout, total = [], [], 0

        def put(a: np.ndarray) -> tuple[int, tuple[int, ...], str]:
            nonlocal total
            a = np.ascontiguousarray(a)
            arrays.append((total, a))
            total += a.nbytes
            return total - a.nbytes, a.shape, a.dtype.str

        for o in observations:
            layout.append(({c: put(a) for c, a in o.images.items()}, None if o.state is None else put(o.state),
                           o.task))
        new = None
        if self.mm is None or total > self.size:
            self.close()
            self.size = max(1 << 20, int(total * 1.25))
            if os.path.isdir(SHM_DIR):
                self.path = os.path.join(SHM_DIR, owned_name(ARENA_PREFIX))
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            else:
                fd, self.path = tempfile.mkstemp(prefix=ARENA_PREFIX)
            try:
                os.ftruncate(fd, self.size)
                self.mm = mmap.mmap(fd, self.size)
            finally:
                os.close(fd)
            new = self.path
        for off, a in arrays:
            np.frombuffer(self.mm, np.uint8, a.nbytes, off)[:] = a.reshape(-1).view(np.uint8)
        return new, layout

    def mapped(self) -> None:
        """The child has answered (it unlinked the file once mapped): make sure the name is gone (the mapping lives
        on in both processes)."""
        if self.path is not None:
            _unlink_quietly(self.path)
            self.path = None

    def close(self) -> None:
        self.mapped()
        if self.mm is not None:
            self.mm.close()
            self.mm = None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:   # already gone: the other process removed it
        pass


def _unpack(mm: mmap.mmap, layout: list) -> list[Observation]:
    def view(spec):
        off, shape, dtype = spec
        return np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=mm, offset=off)

    return [Observation({c: view(a) for c, a in ims.items()}, None if st is None else view(st), task)
            for ims, st, task in layout]


def _child(conn, name: str, kwargs: dict[str, Any], torch_threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from wamkit.policies import make_policy

        policy = make_policy(name, **kwargs)
        if "torch" in sys.modules:
            import torch

            torch.set_num_threads(resolved_threads(torch_threads))
        freeze_heap()   # the policy is built: full collections from now on skip it (core/heap.py)
        conn.send(("ok", (policy.spec, int(policy.max_batch_size()))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("user" if isinstance(e, UserError) else "error", f"{type(e).__name__}: {e}" if not
                   isinstance(e, UserError) else str(e)))
        return
    mm = None
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "close":
                return
            try:
                if msg[0] == "predict":
                    _, path, layout, seeds = msg
                    if path is not None:   # a new (larger) file; the old mapping goes with its last view
                        with open(path, "r+b") as f:
                            mm = mmap.mmap(f.fileno(), 0)
                        _unlink_quietly(path)   # mapped: its name is no longer needed, whatever happens next
                    out: Any = np.asarray(policy.predict(_unpack(mm, layout), seeds), np.float32)
                else:
                    out = policy.warmup(msg[1])
                    freeze_heap()   # and what warm-up built (compiled graphs)
                conn.send(("ok", out))
            except UserError as e:    # the policy refused this input (the server answers 422)
                conn.send(("user", str(e)))
            except Exception as e:  # noqa: BLE001 - the request fails, the child keeps serving
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        policy.close()


class PolicyProcess(Policy):
    """A Policy whose predict/warmup run in a child process (module doc). Calls are serialized (one at a time)."""

    def __init__(self, name: str, kwargs: dict[str, Any] | None = None, torch_threads: int = 0,
                 start_timeout_s: float | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, name, dict(kwargs or {}), int(torch_threads)),
                                 name="wamkit-policy", daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        sweep_orphans(ARENA_PREFIX)   # arenas of servers killed while their child was mapping one
        self._arena = _Arena()
        try:
            self.spec, self._max_batch_size = self._call(None, timeout_s=start_timeout_s)
        except BaseException:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
            raise

    def _call(self, msg: tuple | None, timeout_s: float | None = None, observations=None) -> Any:
        with self._lock:
            try:
                if observations is not None:
                    path, layout = self._arena.pack(observations)
                    msg = ("predict", path, layout, msg[1])
                if msg is not None:
                    self._conn.send(msg)
                if timeout_s is not None and not self._conn.poll(timeout_s):
                    raise RuntimeError(f"policy process gave no answer within {timeout_s} s")
                kind, value = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                raise RuntimeError(f"policy process exited (exit code {self._proc.exitcode})") from None
            finally:
                if observations is not None:
                    self._arena.mapped()
        if kind == "ok":
            return value
        if kind == "user":
            raise UserError(value)
        raise RuntimeError(value)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        """None while the child runs; its exit code once it has died (killed: minus the signal)."""
        return self._proc.exitcode

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        return self._call(("predict", [int(s) for s in seeds]), observations=observations)

    def max_batch_size(self) -> int:
        return self._max_batch_size

    def warmup(self, max_batch_size: int | None = None) -> dict[str, float]:
        return self._call(("warmup", max_batch_size))

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                with self._lock:
                    self._conn.send(("close",))
            except (OSError, BrokenPipeError):
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        self._conn.close()
        self._arena.close()
