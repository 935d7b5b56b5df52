"""The env worker contract: what the evaluation (scheduler, runner, recorder) asks of one env worker, wherever it
runs. `wamkit.envs.worker.EnvWorker` (a local spawned process) and `wamkit.runtime.ray_runtime.RayEnvWorker` (a Ray
actor) both satisfy it; a test checks each class against it.

    worker.start()                         # block until the env is built: spec and tasks known
    obs = await worker.reset(task_id, trial)
    res = await worker.execute(chunk, render_every_step=False, run_to_max_steps=False)
    worker.kill(); worker.restart()        # after a crash or a stall
    worker.close()                         # or `with worker: ...` (start on enter, close on exit)

A worker that died mid-call raises `EnvWorkerCrashed` (`EnvWorkerTimeout` when it was killed for missing its
deadline); an exception of the env itself, the worker alive, raises `EnvWorkerError` with the remote traceback.
One call at a time per worker; many workers may be driven concurrently from one asyncio loop.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from wamkit.core.types import ChunkResult, Observation
from wamkit.envs.base import EnvSpec, TaskInfo


@runtime_checkable
class EnvWorkerLike(Protocol):
    """One env, driven from the parent: async calls with blocking twins, and the lifecycle the scheduler needs."""

    index: int                      # position in the evaluation's worker list (named in errors and logs)
    env_name: str
    spec: EnvSpec | None            # known after start()
    tasks: list[TaskInfo] | None    # known after start()
    render: dict | None             # after start(): what MuJoCo renders with there (render_backend.in_use)

    # ---- lifecycle
    def start(self) -> "EnvWorkerLike":
        """Start the process / actor and block until its env is built; a no-op when it is running."""
        ...

    @property
    def alive(self) -> bool:
        """The process / actor is running (best effort: the next call tells for sure)."""
        ...

    @property
    def pid(self) -> int | None:
        """The pid of the process hosting the env (None before start)."""
        ...

    def kill(self) -> None:
        """Kill it as a crash would: the in-flight or next call raises EnvWorkerCrashed until restart()."""
        ...

    def restart(self) -> "EnvWorkerLike":
        """A fresh process / actor with a fresh env (after a crash or a stall)."""
        ...

    def close(self, timeout: float = 10.0) -> None:
        """Close the env and end the process / actor. Idempotent."""
        ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...

    # ---- calls
    async def reset(self, task_id: int, trial: int) -> Observation: ...

    async def execute(self, actions: Any, render_every_step: bool = False,
                      run_to_max_steps: bool = False) -> ChunkResult: ...

    def reset_sync(self, task_id: int, trial: int) -> Observation: ...

    def execute_sync(self, actions: Any, render_every_step: bool = False,
                     run_to_max_steps: bool = False) -> ChunkResult: ...
