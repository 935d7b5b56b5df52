"""The server worker contract: what the evaluation (ServerInference, start_server_workers, bench) and the action
clients (`worker=`: restart a server that stopped answering) ask of one action-server worker, wherever its process
runs. `wamkit.serve.workers.WamkitServerWorker` / `SGLangServerWorker` (a local process) and
`wamkit.runtime.ray_runtime.RayServerWorker` (a process launched by a Ray actor holding a GPU) satisfy it; a test
checks each class against it.

    w.start(); w.wait_healthy(timeout)     # or `with w: ...` (start + wait on enter, stop on exit)
    client = ActionClient(w.url, worker=w)
    w.healthy(); w.ensure_healthy()        # restart it if its process died or stopped answering
    w.stop()
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ServerWorkerLike(Protocol):
    """One action server process: start, health, restart, stop."""

    default_start_timeout: float   # seconds wait_healthy(None) waits (the caller may raise it for slow model loads)
    starts: int                    # processes started so far (restarts = starts - 1)

    @property
    def url(self) -> str:
        """http://host:port the server answers on."""
        ...

    def start(self) -> "ServerWorkerLike":
        """Launch the server process (a no-op when it runs); returns at once, see wait_healthy()."""
        ...

    def wait_healthy(self, timeout: float | None = None) -> "ServerWorkerLike":
        """Block until the server answers /health as the server started here (else raise ServerStartError)."""
        ...

    def healthy(self, timeout: float = 2.0) -> bool:
        """The server answers /health now."""
        ...

    def ensure_healthy(self, timeout: float | None = None) -> bool:
        """Restart the server if it died or stopped answering; True when a restart happened."""
        ...

    def restart(self, timeout: float | None = None) -> "ServerWorkerLike":
        """Stop, start, wait until healthy; the url stays valid."""
        ...

    def stop(self) -> None:
        """End the server process (SIGTERM, then SIGKILL). Idempotent."""
        ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...
