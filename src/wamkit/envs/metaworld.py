"""MetaWorld (metaworld 3.1.1, goal-observable V3 tasks) behind the wamkit Env interface.

- Tasks by name; `trial` picks a seeded init state: the env's np_random is seeded from (seed, crc32(task name),
  trial) right before reset, and MetaWorld samples the object/goal reset vector from it, so the same (task, trial)
  gives the same scene every time, in every process, independent of global RNG state.
- Observation.state is the env's full 39-D observation vector (float32): what the scripted experts read.
- Success from info["success"]; action 4-D in [-1, 1] (xyz delta, gripper effort: -1 open, +1 close).
- Cameras are rendered with our own mujoco.Renderer, only for the observations that are used (render skipping:
  rendering reads the state and never touches the physics). MetaWorld's corner cameras are mounted upside down, so
  every camera image is rotated 180 degrees (CAMERA_FLIP) to come out upright (pinned by tests/test_envs_metaworld.py).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import numpy as np

from wamkit.envs.process_setup import setup_headless_gl

setup_headless_gl()

from wamkit.core.config import check_number  # noqa: E402
from wamkit.core.errors import ConfigError  # noqa: E402
from wamkit.core.types import ChunkResult, Observation  # noqa: E402
from wamkit.envs.base import Env, EnvSpec, TaskInfo  # noqa: E402
from wamkit.envs.render_backend import apply_options, check_render_options  # noqa: E402
from wamkit.envs.render_client import client_for  # noqa: E402
from wamkit.envs.render_service import check_renderer  # noqa: E402

# Observation.images key -> MetaWorld camera name.
CAMERAS: dict[str, str] = {"image": "corner2", "wrist_image": "gripperPOV"}
# Rotate every camera by 180 degrees (the corner cameras have their image y axis pointing down in the world).
CAMERA_FLIP = True
STATE_DIM = 39
ACTION_DIM = 4
CONTROL_HZ = 80.0             # MetaWorld: frame_skip 5 x 2.5 ms physics step
TRIALS_PER_TASK = 50          # distinct seeded init states per task (same count as LIBERO's protocol)
# render_quality: "model" keeps the scene's own settings (4x MSAA, 4096^2 shadow map); "fast" renders without MSAA
# and with a 1024^2 shadow map: 3x cheaper on a CPU renderer (210 -> 67 ms per 224^2 frame under llvmpipe), nearly
# the same pixels (tests/test_envs_metaworld.py bounds the difference). Both are deterministic.
RENDER_QUALITY = {"model": None, "fast": {"offsamples": 0, "shadowsize": 1024}}
# Tasks whose scripted experts (metaworld.policies) succeed reliably with the default expert horizon.
DEFAULT_TASKS: tuple[str, ...] = ("reach-v3", "push-v3", "pick-place-v3", "drawer-open-v3",
                                  "button-press-topdown-v3", "door-open-v3")
_SUFFIX = "-v3"


def task_instruction(task_name: str) -> str:
    """Instruction text of a MetaWorld task: 'pick-place-v3' -> 'pick place'.
    The inverse lives in wamkit.policies.metaworld_expert (policies do not import envs); a test pins both."""
    if not task_name.endswith(_SUFFIX):
        raise ConfigError(f"MetaWorld task names end with {_SUFFIX!r}: {task_name!r}")
    return task_name[: -len(_SUFFIX)].replace("-", " ")


def all_task_names() -> list[str]:
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    return sorted(ALL_V3_ENVIRONMENTS)


def init_rng(seed: int, task_name: str, trial: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(task_name.encode()), int(trial)])


@dataclass(frozen=True)
class MetaWorldConfig:
    suite: str = "mt"                  # the one suite: mt (the tasks are chosen by `tasks`)
    tasks: tuple[str, ...] = DEFAULT_TASKS  # MetaWorld V3 task names (task_id = position in this list)
    image_size: int = 224              # square side of every rendered camera image
    cameras: tuple[str, ...] = ("image",)  # Observation.images keys: image (corner2) | wrist_image (gripperPOV)
    max_steps: int = 150               # policy steps per episode
    seed: int = 0                      # seeds every (task, trial) init state together with them
    render_quality: str = "model"      # model (the scene's own settings) | fast (no MSAA, smaller shadow map)
    render_backend: str = "auto"       # auto (measured once per machine; a set MUJOCO_GL wins) | egl | osmesa
    render_device: str = "auto"        # EGL device index (MUJOCO_EGL_DEVICE_ID) | auto (several GPUs: not the model's)
    renderer: str = "own"              # own (a GL context per env process and task) | shared (render processes
                                       # drawing every env's frames, one GL context each; same pixels)
    render_processes: int = 1          # renderer=shared: how many render processes (envs spread over them)

    def validate(self) -> None:
        if self.suite != "mt":
            raise ConfigError(f"unknown MetaWorld suite {self.suite!r}; valid choices: mt")
        bad = [c for c in self.cameras if c not in CAMERAS]
        if bad:
            raise ConfigError(f"unknown MetaWorld camera(s) {bad!r}; valid: {', '.join(CAMERAS)}")
        names = all_task_names()
        unknown = [t for t in self.tasks if t not in names]
        if unknown or not self.tasks:
            raise ConfigError(f"unknown MetaWorld task(s) {unknown or self.tasks!r}; valid choices: "
                              f"{', '.join(names)}")
        check_number("image_size", self.image_size, lo=1)
        check_number("max_steps", self.max_steps, lo=1)
        check_render_options(self.render_backend, self.render_device)
        check_renderer(self.renderer, self.render_processes)
        if self.render_quality not in RENDER_QUALITY:
            raise ConfigError(f"render_quality must be one of {', '.join(RENDER_QUALITY)}, "
                              f"got {self.render_quality!r}")


class MetaWorldEnv(Env):
    name = "metaworld"
    config_class = MetaWorldConfig
    action_dim = ACTION_DIM
    state_dim = STATE_DIM
    default_suite = MetaWorldConfig.suite

    def __init__(self, config: MetaWorldConfig | None = None, **kwargs):
        self.config = cfg = self.make_config(config, **kwargs)
        apply_options(cfg.render_backend, cfg.render_device, cfg.image_size)  # built here, not by make_env
        self.render_quality = cfg.render_quality
        self._client = client_for(cfg.renderer, cfg.render_processes)   # renderer=shared: frames from elsewhere
        self._model_keys: dict[int, str] = {}    # task_id -> its model's key at the shared renderer
        self.task_names, self.cameras = cfg.tasks, cfg.cameras
        self.image_size, self.max_steps, self.seed = cfg.image_size, cfg.max_steps, cfg.seed
        self.spec = EnvSpec(env=self.name, suite=cfg.suite, action_dim=ACTION_DIM, cameras=cfg.cameras,
                            image_size=self.image_size, state_dim=STATE_DIM, max_steps=self.max_steps,
                            control_hz=CONTROL_HZ)
        self._tasks = [TaskInfo(task_id=i, name=n, instruction=task_instruction(n), num_trials=TRIALS_PER_TASK)
                       for i, n in enumerate(cfg.tasks)]
        # task_id -> metaworld env, the most recently used last: ~15 MB each, so the KEPT_ENVS last used are kept (a
        # task visited again is built again, to the same bit-identical scene: its state right after construction)
        self._envs: dict[int, object] = {}
        # task_id -> mujoco.Renderer: ~110-210 MB of GL buffers each, so only the current task's is kept
        self._renderers: dict[int, object] = {}
        self._initial_states: dict[int, np.ndarray] = {}  # task_id -> full MuJoCo state right after construction
        self._task_id: int | None = None
        self._obs: np.ndarray | None = None
        self._episode_steps, self._success, self._over = 0, False, True
        self.renders = 0
        self.render_s = 0.0           # seconds spent rendering (bench: where a chunk's time goes)

    def tasks(self) -> list[TaskInfo]:
        return list(self._tasks)

    def reset(self, task_id: int, trial: int) -> Observation:
        if not 0 <= task_id < len(self._tasks):
            raise ConfigError(f"task_id {task_id} out of range ({len(self._tasks)} tasks)")
        if not 0 <= trial < TRIALS_PER_TASK:
            raise ConfigError(f"trial {trial} out of range (0..{TRIALS_PER_TASK - 1})")
        env = self._env(task_id)
        name = self._tasks[task_id].name
        # MetaWorld samples the reset vector from env.np_random (resampling until the task's own constraints hold,
        # e.g. goal far enough from the object; a frozen vector that violates them would loop forever), so we
        # seed np_random per (seed, task, trial) and let it sample.
        # MetaWorld's reset steps the physics from wherever the last episode left it (hand reset by 50 mocap
        # steps), so the new scene depended on history in the last bits; restore the full state of a fresh env
        # first: (task, trial) -> bit-identical scene, whatever ran before.
        self._restore_initial_state(task_id)
        env._freeze_rand_vec = False
        env.seeded_rand_vec = True
        env.seed(int(init_rng(self.seed, name, trial).integers(2**31 - 1)))
        obs, _ = env.reset()
        env._freeze_rand_vec = True  # keep this scene if anything resets the model again
        self._task_id, self._obs = task_id, obs
        self._episode_steps, self._success, self._over = 0, False, False
        return self._observation()

    def execute(self, actions: np.ndarray, *, render_every_step: bool = False,
                run_to_max_steps: bool = False) -> ChunkResult:
        if self._task_id is None or self._over:
            raise RuntimeError("execute() called without an episode in progress; call reset() first")
        actions = np.asarray(actions, dtype=np.float32)
        if actions.ndim != 2 or actions.shape[1] != ACTION_DIM or len(actions) == 0:
            raise ValueError(f"actions must have shape (H>=1, {ACTION_DIM}), got {actions.shape}")
        env = self._envs[self._task_id]
        n = min(len(actions), self.max_steps - self._episode_steps)
        frames: list[np.ndarray] = []
        steps, done = 0, False
        for i in range(n):
            obs, _, _, _, info = env.step(np.clip(actions[i], -1.0, 1.0))
            self._obs = obs
            steps += 1
            self._episode_steps += 1
            if render_every_step:
                frames.append(self._render(self.cameras[0]) if self.cameras else np.zeros((0, 0, 3), np.uint8))
            if float(info.get("success", 0.0)) > 0.0:
                self._success = True
                if not run_to_max_steps:
                    done = True
                    break
        if self._episode_steps >= self.max_steps:
            done = True
        self._over = done
        obs = None
        if not done:
            # render skipping: only this observation is rendered (or reused from the per-step frame)
            images = {}
            if render_every_step and self.cameras:
                images[self.cameras[0]] = frames[-1]
            obs = self._observation(images)
        return ChunkResult(obs=obs, success=self._success, done=done, steps=steps,
                           episode_steps=self._episode_steps, frames=frames)

    def close(self) -> None:
        for task_id in list(self._envs):
            self._drop_task(task_id)
        if self._client is not None:
            self._client.close()
        self._renderers, self._envs, self._task_id = {}, {}, None

    # ---- internals ---------------------------------------------------------------------------------------------
    KEPT_ENVS = 8

    def _drop_task(self, task_id: int) -> None:
        """Close a task's env and renderer (the next reset of the task builds them again)."""
        if task_id in self._renderers:
            _close_quietly(self._renderers.pop(task_id))
        if task_id in self._envs:
            _close_quietly(self._envs.pop(task_id))
        self._initial_states.pop(task_id, None)
        self._model_keys.pop(task_id, None)

    def _env(self, task_id: int):
        if task_id in self._envs:
            self._envs[task_id] = self._envs.pop(task_id)   # most recently used last
        else:
            while len(self._envs) >= self.KEPT_ENVS:
                self._drop_task(next(iter(self._envs)))
            from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

            env = ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[self._tasks[task_id].name + "-goal-observable"](seed=self.seed)
            env.max_path_length = max(int(env.max_path_length), self.max_steps + 1)
            for k, v in (RENDER_QUALITY[self.render_quality] or {}).items():   # read when a renderer is made
                setattr(env.model.vis.quality, k, v)
            self._envs[task_id] = env
            if self._client is not None:   # the model as built: the same bytes in every env process of this task
                self._model_keys[task_id] = self._client.model_id(env.model)
            import mujoco

            spec = mujoco.mjtState.mjSTATE_INTEGRATION
            state = np.empty(mujoco.mj_stateSize(env.model, spec), np.float64)
            mujoco.mj_getState(env.model, env.data, state, spec)
            self._initial_states[task_id] = state
        return self._envs[task_id]

    def _restore_initial_state(self, task_id: int) -> None:
        import mujoco

        env = self._envs[task_id]
        mujoco.mj_setState(env.model, env.data, self._initial_states[task_id], mujoco.mjtState.mjSTATE_INTEGRATION)
        mujoco.mj_forward(env.model, env.data)

    def _render(self, cam: str) -> np.ndarray:
        import mujoco

        env = self._envs[self._task_id]
        t0 = time.perf_counter()
        if self._client is not None:
            img = self._client.render(self._model_keys[self._task_id], env.model, env.data, CAMERAS[cam],
                                      self.image_size, self.image_size)
        else:
            r = self._renderers.get(self._task_id)
            if r is None:
                for other in list(self._renderers):
                    _close_quietly(self._renderers.pop(other))
                r = self._renderers[self._task_id] = mujoco.Renderer(env.model, self.image_size, self.image_size)
            r.update_scene(env.data, camera=CAMERAS[cam])
            img = r.render()
        self.render_s += time.perf_counter() - t0
        self.renders += 1
        return np.ascontiguousarray(img[::-1, ::-1]) if CAMERA_FLIP else img.copy()

    def _observation(self, images: dict | None = None) -> Observation:
        images = dict(images or {})
        for cam in self.cameras:
            if cam not in images:
                images[cam] = self._render(cam)
        return Observation(images=images, state=np.asarray(self._obs, dtype=np.float32),
                           task=self._tasks[self._task_id].instruction)


def _close_quietly(thing) -> None:
    try:
        thing.close()
    except Exception:  # noqa: BLE001 - best effort: a GL context or env already gone
        pass
