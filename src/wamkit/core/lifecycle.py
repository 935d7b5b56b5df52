"""`with obj:` for the things that hold a process, an actor, a thread or open files: one definition of __enter__ /
__exit__, three shapes of it.

- `ClosingContext`: entering returns the object; leaving calls `_release(failed)`, by default `close()`.
- `StartClosingContext`: entering `start()`s it (an env worker: its process or actor, its env built); leaving
  `close()`s it.
- `StartStopContext`: entering `start()`s it and waits until it answers (`wait_healthy()`); when that wait fails,
  what was started is stopped before the error propagates. Leaving `stop()`s it (a server worker).

A class changes what leaving means by overriding `_release(failed)` (the LeRobot writer finalizes on success and
discards its temporary files on an error); it never writes its own __enter__ / __exit__.
"""

from __future__ import annotations

from typing import Any, TypeVar

_T = TypeVar("_T", bound="ClosingContext")


class ClosingContext:
    """`with obj:` -> obj; on the way out (error or not) `obj._release(failed)`, which calls `close()`."""

    def _release(self, failed: bool) -> None:
        self.close()  # type: ignore[attr-defined]

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._release(exc_type is not None)


class StartClosingContext(ClosingContext):
    """`with worker:` -> worker.start(); on the way out `close()`."""

    def __enter__(self: _T) -> _T:
        self.start()  # type: ignore[attr-defined]
        return self


class StartStopContext(ClosingContext):
    """`with worker:` -> worker.start(), then worker.wait_healthy() (a failure there stops it again); on the way out
    `stop()`."""

    def _release(self, failed: bool) -> None:
        self.stop()  # type: ignore[attr-defined]

    def __enter__(self: _T) -> _T:
        self.start()  # type: ignore[attr-defined]
        try:
            self.wait_healthy()  # type: ignore[attr-defined]
        except BaseException:
            self._release(True)
            raise
        return self
