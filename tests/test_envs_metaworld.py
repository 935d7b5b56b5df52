"""MetaWorld env on the real simulator: expert success, determinism, upright camera images."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.metaworld]
pytest.importorskip("metaworld")


def _episode(env, policy, task_id, trial):
    o = env.reset(task_id, trial)
    while True:
        r = env.execute(policy.predict([o], [0])[0])
        if r.done:
            return r
        o = r.obs


def test_expert_succeeds_5_of_6():
    from wamkit.envs.metaworld import MetaWorldEnv
    from wamkit.policies.registry import make_policy

    env = MetaWorldEnv(tasks=("reach-v3", "drawer-open-v3"), cameras=(), max_steps=150)
    policy = make_policy("metaworld-expert")
    try:
        results = [_episode(env, policy, t, k) for t in range(2) for k in range(3)]
    finally:
        env.close()
    assert sum(r.success for r in results) >= 5, [(r.success, r.episode_steps) for r in results]
    assert all(r.done and r.obs is None for r in results)


def test_determinism_and_trials_differ():
    from wamkit.envs.metaworld import MetaWorldEnv

    env = MetaWorldEnv(tasks=("pick-place-v3",), cameras=("image",), image_size=64, max_steps=30)
    acts = np.random.default_rng(0).uniform(-1, 1, (6, 4)).astype(np.float32)
    try:
        runs = []
        for trial in (1, 1, 2):
            o = env.reset(0, trial)
            r = env.execute(acts)
            runs.append((o, r))
    finally:
        env.close()
    (o1, r1), (o2, r2), (o3, _) = runs
    assert o1.state.shape == (39,) and o1.state.dtype == np.float32 and o1.task == "pick place"
    for a, b in ((o1, o2), (r1.obs, r2.obs)):
        np.testing.assert_array_equal(a.state, b.state)
        np.testing.assert_array_equal(a.images["image"], b.images["image"])
    assert not np.array_equal(o1.state, o3.state)  # another trial, another init state
    assert (r1.steps, r1.episode_steps) == (6, 6)


def test_camera_images_are_upright():
    """The returned image's 'up' direction must point up in the world: MetaWorld's corner cameras have their
    image y axis pointing down, so the env rotates frames by 180 degrees (CAMERA_FLIP)."""
    import mujoco

    from wamkit.envs import metaworld as M

    env = M.MetaWorldEnv(tasks=("reach-v3",), cameras=("image",), image_size=64)
    try:
        env.reset(0, 0)
        e = env._envs[0]
        cam_id = mujoco.mj_name2id(e.model, mujoco.mjtObj.mjOBJ_CAMERA, M.CAMERAS["image"])
        cam_up_world = e.data.cam_xmat[cam_id].reshape(3, 3)[:, 1]  # camera y axis = up of the unflipped image
        image_up_world = -cam_up_world if M.CAMERA_FLIP else cam_up_world
        assert image_up_world[2] > 0.3
        # and the frame is the flipped render
        raw = mujoco.Renderer(e.model, 64, 64)
        raw.update_scene(e.data, camera=M.CAMERAS["image"])
        np.testing.assert_array_equal(env._render("image"), raw.render()[::-1, ::-1])
        raw.close()
    finally:
        env.close()


def test_render_quality_fast_is_close_and_deterministic():
    """render_quality=fast (no MSAA, 1024^2 shadow map) changes only edge and shadow pixels a little; the same
    state gives the same frame every time; an unknown value is a clear ConfigError."""
    from wamkit.core.errors import ConfigError
    from wamkit.envs.metaworld import MetaWorldEnv

    frames = {}
    for q in ("model", "fast", "fast"):
        env = MetaWorldEnv(tasks=("pick-place-v3",), cameras=("image",), image_size=96, render_quality=q)
        try:
            frames.setdefault(q, []).append(env.reset(0, 3).images["image"].astype(np.int16))
            assert env._envs[0].model.vis.quality.offsamples == (0 if q == "fast" else 4)
        finally:
            env.close()
    np.testing.assert_array_equal(frames["fast"][0], frames["fast"][1])
    diff = np.abs(frames["fast"][0] - frames["model"][0])
    assert 0 < diff.mean() < 12, diff.mean()       # not the same renderer settings, but the same scene
    assert np.median(diff) <= 2
    with pytest.raises(ConfigError, match="render_quality"):
        MetaWorldEnv(tasks=("reach-v3",), render_quality="ultra")


def test_an_env_visiting_many_tasks_keeps_one_renderer_and_a_bounded_set_of_envs(monkeypatch):
    """A probe's finding: an env process kept a mujoco.Renderer (110-210 MB of GL buffers) and an env for every task
    it ever loaded: a serial 12-task run grew to 2.5 GB. Now one renderer (the current task's) and the KEPT_ENVS
    most recently used envs are kept; a task visited again after its env was dropped is built again to the same
    scene, bit for bit."""
    from wamkit.envs.metaworld import MetaWorldEnv

    monkeypatch.setattr(MetaWorldEnv, "KEPT_ENVS", 2)
    env = MetaWorldEnv(tasks=("reach-v3", "push-v3", "drawer-open-v3"), cameras=("image",), image_size=32,
                       max_steps=10)
    acts = np.random.default_rng(1).uniform(-1, 1, (3, 4)).astype(np.float32)
    try:
        first = env.reset(0, 1), env.execute(acts).obs
        seen = []
        for task_id in (1, 2, 0):
            o = env.reset(task_id, 1)
            seen.append((sorted(env._renderers), sorted(env._envs)))
        again = o, env.execute(acts).obs
    finally:
        env.close()
    assert seen == [([1], [0, 1]), ([2], [1, 2]), ([0], [0, 2])]
    assert env._renderers == {} and env._envs == {}
    for a, b in zip(first, again):   # task 0 built again after its env was dropped: the same scene and images
        np.testing.assert_array_equal(a.state, b.state)
        np.testing.assert_array_equal(a.images["image"], b.images["image"])
