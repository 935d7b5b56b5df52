"""The environment contract every simulator implements (`Env`, `EnvSpec`, `TaskInfo`: this file is its one place),
and the registry that builds them by name.

An Env hosts one simulator instance. One episode is: `reset(task_id, trial)` -> Observation, then repeated
`execute(chunk)` until `ChunkResult.done`. Only steps whose observation is used are rendered (render skipping):
`execute` renders once, after the last executed step of the chunk, unless `render_every_step=True`
(the single-batch baseline, and video recording). Episode step counting, max steps, wait steps and success
checks live inside the env, so every scheduler gets the same answer.
"""

from __future__ import annotations

import abc
import importlib
import time
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from wamkit.core.config import build_options
from wamkit.core.errors import unknown_choice
from wamkit.core.types import ChunkResult, Observation


@dataclass(frozen=True)
class TaskInfo:
    task_id: int
    name: str          # short name, e.g. the bddl file stem or "pick-place-v3"
    instruction: str   # natural-language task text given to the policy
    num_trials: int    # number of distinct init states


@dataclass(frozen=True)
class EnvSpec:
    env: str                  # "libero" | "metaworld"
    suite: str                # e.g. "libero_object", or "mt" for MetaWorld
    action_dim: int
    cameras: tuple[str, ...]  # camera keys of Observation.images
    image_size: int
    state_dim: int
    max_steps: int            # policy steps per episode (not counting wait steps)
    control_hz: float


C = TypeVar("C")


class Env(abc.ABC):
    """One simulator instance. Not thread-safe; one per process."""

    name: ClassVar[str]                # registry name; also spec.env
    config_class: ClassVar[type]       # the dataclass of its options (make_env refuses any other key)
    # known before an env is built (the same as its spec's); 0 = not fixed
    action_dim: ClassVar[int] = 0
    state_dim: ClassVar[int] = 0

    config: Any                        # its options, an instance of config_class
    spec: EnvSpec

    @classmethod
    def make_config(cls, config: C | None = None, **kwargs) -> C:
        """`config` (or the defaults) with `kwargs` on top, checked and coerced by wamkit.core.config's rules: an
        unknown key is a ConfigError naming it and the valid keys; CLI strings become the field types."""
        return build_options(cls.config_class, kwargs, config, kind="env_args", name=cls.name)

    @abc.abstractmethod
    def tasks(self) -> list[TaskInfo]:
        """Tasks of the configured suite, indexed by task_id."""

    @abc.abstractmethod
    def reset(self, task_id: int, trial: int) -> Observation:
        """Start an episode at (task, init state `trial`); returns the first observation (wait steps done)."""

    @abc.abstractmethod
    def execute(self, actions: np.ndarray, *, render_every_step: bool = False,
                run_to_max_steps: bool = False) -> ChunkResult:
        """Execute an action chunk (H, action_dim). Stops early at success (unless run_to_max_steps) or max steps.

        Renders only the observation after the last executed step (render skipping), or every step when
        render_every_step (frames then also come back in ChunkResult.frames, for video)."""

    def close(self) -> None:  # noqa: B027
        pass


_REGISTRY: dict[str, str] = {
    "libero": "wamkit.envs.libero:LiberoEnv",
    "metaworld": "wamkit.envs.metaworld:MetaWorldEnv",
}


def timed_execute(env: Env, actions: np.ndarray, *, render_every_step: bool, run_to_max_steps: bool) -> ChunkResult:
    """env.execute with what it cost the env's own process on the result: worker_s (wall), worker_cpu_s (this
    process's CPU time), worker_render_s (camera rendering, for an env that counts it in `render_s`). Every env
    runner (the local worker process, the Ray actor) calls this, so the figures mean the same everywhere."""
    r0 = getattr(env, "render_s", None)
    t0, c0 = time.perf_counter(), time.process_time()
    res = env.execute(actions, render_every_step=render_every_step, run_to_max_steps=run_to_max_steps)
    res.worker_s, res.worker_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if r0 is not None:
        res.worker_render_s = env.render_s - r0
    return res


def register_env(name: str, target: str) -> None:
    """Register an env class by 'module:Class' (imported lazily)."""
    _REGISTRY[name] = target


def default_suite(name: str) -> str:
    """The env's standard suite (its class's `default_suite`), "" for an unknown env (named by env_class later)."""
    if name not in _REGISTRY:
        return ""
    return getattr(env_class(name), "default_suite", "")


def env_names() -> list[str]:
    return sorted(_REGISTRY)


def env_class(name: str):
    if name not in _REGISTRY:
        raise unknown_choice("env", name, env_names())
    mod, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def make_env(name: str, **kwargs) -> Env:
    """Build an env by registered name; kwargs go to its constructor (suite, image_size, ...). A key that is not one of
    its options is a ConfigError naming it (`env_args.foo`) and the valid keys."""
    from wamkit.core.config import check_options
    from wamkit.envs.render_backend import apply_render_options

    cls = env_class(name)
    apply_render_options(cls, kwargs)   # MUJOCO_GL & co. from render_backend, before anything imports mujoco
    check_options("env_args", name, cls, kwargs)
    return cls(**kwargs)
