"""PolicyProcess: the served policy in a process of its own (`wamkit serve policy_process=true`), so the server's event
loop (HTTP, decoding, batching, responses) and the policy's host-side work never share one GIL.

Why: in one process, a CUDA policy's predict thread holds the GIL while it launches kernels (and while a launch waits
for room in a full launch queue, inside the driver, where Python cannot switch threads), so the event loop decodes the
next requests only in the gaps: they trickle into the batcher and batches stay small. Here the event loop's process
does no policy work at all, and the policy process's GIL belongs to predict.

- The child is started with multiprocessing's spawn context, builds the policy with make_policy(name, **kwargs) and
  answers over one Pipe: ("predict", observations, seeds) -> actions, ("warmup", n) -> seconds per step, ("close",).
  Observations travel pickled (one copy of the images per batch, a few ms for 64 observations of two 256 px cameras).
- Errors: a failing build raises here (UserError stays UserError: `wamkit serve` exits 2 with its line); a failing
  predict raises RuntimeError with the child's message (the server answers 500 and keeps serving); a child that died
  raises RuntimeError on every call.
- The child ignores SIGINT/SIGTERM (a server worker signals the whole process group; the parent flushes its queued
  batches first) and exits when the parent closes the pipe or dies (EOF).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Any, Sequence

import numpy as np

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies.base import Policy


def _child(conn, name: str, kwargs: dict[str, Any], torch_threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from wamkit.policies import make_policy

        policy = make_policy(name, **kwargs)
        if "torch" in sys.modules:
            import torch

            torch.set_num_threads(torch_threads or max(1, min(4, os.cpu_count() or 1)))
        conn.send(("ok", (policy.spec, int(policy.max_batch_size()))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("user" if isinstance(e, UserError) else "error", f"{type(e).__name__}: {e}" if not
                   isinstance(e, UserError) else str(e)))
        return
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
                    out: Any = np.asarray(policy.predict(msg[1], msg[2]), np.float32)
                else:
                    out = policy.warmup(msg[1])
                conn.send(("ok", out))
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
        try:
            self.spec, self._max_batch_size = self._call(None, timeout_s=start_timeout_s)
        except BaseException:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
            raise

    def _call(self, msg: tuple | None, timeout_s: float | None = None) -> Any:
        with self._lock:
            try:
                if msg is not None:
                    self._conn.send(msg)
                if timeout_s is not None and not self._conn.poll(timeout_s):
                    raise RuntimeError(f"policy process gave no answer within {timeout_s} s")
                kind, value = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                raise RuntimeError(f"policy process exited (exit code {self._proc.exitcode})") from None
        if kind == "ok":
            return value
        if kind == "user":
            raise UserError(value)
        raise RuntimeError(value)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        return self._call(("predict", list(observations), [int(s) for s in seeds]))

    def max_batch_size(self) -> int:
        return self._max_batch_size

    def warmup(self, max_batch: int | None = None) -> dict[str, float]:
        return self._call(("warmup", max_batch))

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
