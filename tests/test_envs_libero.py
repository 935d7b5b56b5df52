"""LIBERO env on the real simulator: determinism, render skipping == render every step, wait steps, max steps.

One env (libero_object task 0, 128 px, max_steps=20) is shared by the module: ~2.5 GB and a few seconds per reset."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.libero]
pytest.importorskip("libero.libero")

from wamkit.envs import libero_conventions as C  # noqa: E402

CHUNK = 8


def _actions(n=CHUNK, seed=0):
    a = np.random.default_rng(seed).uniform(-0.5, 0.5, (n, 7))
    a[:, -1] = -1.0
    return a


def _same_obs(a, b):
    assert a.task == b.task
    assert set(a.images) == set(b.images)
    for k in a.images:
        np.testing.assert_array_equal(a.images[k], b.images[k], err_msg=k)
    np.testing.assert_array_equal(a.state, b.state)


@pytest.fixture(scope="module")
def env():
    from wamkit.envs.libero import LiberoEnv

    e = LiberoEnv(suite="libero_object", image_size=128, max_steps=20)
    yield e
    e.close()


@pytest.fixture(scope="module")
def skipped_run(env):
    """(first obs, chunk result) of one episode start with render skipping."""
    o = env.reset(0, 0)
    r = env.execute(_actions())
    return o, r


def test_tasks_and_spec(env):
    ts = env.tasks()
    assert len(ts) == 10 and all(t.num_trials == C.NUM_INIT_STATES for t in ts)
    assert ts[0].instruction == "pick up the alphabet soup and place it in the basket"
    assert env.spec.max_steps == 20 and env.spec.cameras == ("image", "wrist_image")
    from wamkit.envs.libero import LiberoEnv

    assert LiberoEnv(suite="libero_10").spec.max_steps == 520  # suite default (no sim built)


def test_reset_obs_and_wait_steps(env, skipped_run):
    o, _ = skipped_run
    assert o.state.dtype == np.float32 and o.state.shape == (8,)
    assert {k: v.shape for k, v in o.images.items()} == {"image": (128, 128, 3), "wrist_image": (128, 128, 3)}
    assert all(v.dtype == np.uint8 and v.std() > 5 for v in o.images.values())  # real frames, not blanks


def test_determinism_same_episode_twice(env, skipped_run):
    o1, r1 = skipped_run
    o2 = env.reset(0, 0)
    assert env._env.env.timestep == C.NUM_WAIT_STEPS  # robosuite counts the wait steps since the hard reset
    r2 = env.execute(_actions())
    _same_obs(o1, o2)
    _same_obs(r1.obs, r2.obs)
    assert (r1.steps, r1.episode_steps, r1.done) == (r2.steps, r2.episode_steps, r2.done) == (CHUNK, CHUNK, False)


def test_render_skipping_equals_render_every_step_then_max_steps(env, skipped_run):
    o1, r1 = skipped_run
    o2 = env.reset(0, 0)
    n0 = env.renders
    from wamkit.envs.base import timed_execute

    r2 = timed_execute(env, _actions(), render_every_step=True, run_to_max_steps=False)
    assert env.renders - n0 == 2 * CHUNK  # both cameras, every step
    assert 0 < r2.worker_render_s < r2.worker_s and r2.worker_cpu_s > 0   # the chunk's rendering, timed
    assert len(r2.frames) == CHUNK
    _same_obs(o1, o2)
    _same_obs(r1.obs, r2.obs)  # frames observed with render skipping == frames of the every-step run
    np.testing.assert_array_equal(r2.frames[-1], r2.obs.images["image"])

    # max steps (20): 8 done, 16 more requested -> 12 executed, episode over, nothing rendered
    n0, s0 = env.renders, env.render_s
    r3 = env.execute(_actions(16, seed=1))
    assert (r3.steps, r3.episode_steps, r3.done, r3.obs) == (12, 20, True, None)
    assert env.renders == n0 and env.render_s == s0
    with pytest.raises(RuntimeError):
        env.execute(_actions(1))


def test_soft_reset_of_a_loaded_task_equals_a_hard_reset(env, skipped_run):
    """The next episode of the task already loaded takes robosuite's soft reset (no scene rebuild); its observations
    and trajectory are bit-identical to a hard reset's, even after an episode that closed the gripper (the one
    piece of state a soft reset would otherwise carry over)."""
    closing = _actions(seed=3)
    closing[:, -1] = 1.0
    env.reset(0, 0)
    env.execute(closing)
    hard0, soft0 = env.resets
    o_soft = env.reset(0, 1)                       # same task: soft
    r_soft = env.execute(_actions(seed=4))
    assert env.resets == [hard0, soft0 + 1]
    env.reset(1, 0)                                # another task: hard
    o_hard = env.reset(0, 1)                       # back to task 0: hard again
    r_hard = env.execute(_actions(seed=4))
    assert env.resets == [hard0 + 2, soft0 + 1]
    _same_obs(o_soft, o_hard)
    _same_obs(r_soft.obs, r_hard.obs)


def test_shared_renderer_gives_the_same_frames(env):
    """renderer=shared: robosuite's camera sensors draw through a render process (its visual options, scene
    capacity and image convention travel with each request): the same frames after a reset, a chunk, a soft reset
    and a hard reset to another task, both cameras."""
    from wamkit.envs.libero import LiberoEnv

    shared = LiberoEnv(suite="libero_object", image_size=128, max_steps=20, renderer="shared")
    try:
        for task, trial in ((0, 0), (0, 1), (1, 0)):
            _same_obs(env.reset(task, trial), shared.reset(task, trial))
            _same_obs(env.execute(_actions(seed=task + trial)).obs, shared.execute(_actions(seed=task + trial)).obs)
        assert shared._client.requests == 12 == shared.renders   # every frame came from the render process
    finally:
        shared.close()
