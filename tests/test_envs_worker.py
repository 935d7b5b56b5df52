"""EnvWorker: results through the process equal in-process results; crash detection; restart; clean shutdown.
Uses MetaWorld (cheap to build) so the whole file runs in seconds."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.metaworld]
pytest.importorskip("metaworld")

from wamkit.envs.worker import EnvWorker, EnvWorkerCrashed  # noqa: E402

KW = dict(tasks=("reach-v3", "push-v3"), cameras=("image", "wrist_image"), image_size=64, max_steps=30)
ACTS = np.random.default_rng(0).uniform(-1, 1, (5, 4)).astype(np.float32)


def _same(a, b):
    assert a.task == b.task and set(a.images) == set(b.images)
    for k in a.images:
        np.testing.assert_array_equal(a.images[k], b.images[k])
    np.testing.assert_array_equal(a.state, b.state)


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_worker_matches_in_process_sync_and_async():
    from wamkit.envs.metaworld import MetaWorldEnv

    env = MetaWorldEnv(**KW)
    o_ref = env.reset(1, 3)
    r_ref = env.execute(ACTS)
    env.close()

    workers = [EnvWorker("metaworld", KW, index=i) for i in range(2)]
    for w in workers:
        w.start()
    try:
        assert workers[0].spec == env.spec and [t.name for t in workers[0].tasks] == ["reach-v3", "push-v3"]
        assert workers[0].loaded_task is None
        _same(workers[0].reset_sync(1, 3), o_ref)
        assert workers[0].loaded_task == 1
        # the env processes run single-threaded numeric libraries; this process's environment is left as it was
        from processes import start_environ

        child_env = [k + b"=" + v for k, v in start_environ(workers[0].pid).items()]
        from wamkit.envs.process_setup import SINGLE_THREAD_VARS

        for v in SINGLE_THREAD_VARS:
            if v not in os.environ:
                assert f"{v}=1".encode() in child_env
        r = workers[0].execute_sync(ACTS)
        _same(r.obs, r_ref.obs)
        assert (r.steps, r.episode_steps, r.done, r.success) == (r_ref.steps, r_ref.episode_steps, r_ref.done,
                                                                r_ref.success)

        async def episode(w):
            o = await w.reset(1, 3)
            return o, await w.execute(ACTS)

        async def both():
            return await asyncio.gather(*(episode(w) for w in workers))

        for o, r in asyncio.run(both()):
            _same(o, o_ref)
            _same(r.obs, r_ref.obs)
    finally:
        pids = [w.pid for w in workers]
        shm_names = [w._shm.name for w in workers]
        for w in workers:
            w.close()
    assert all(_gone(p) for p in pids)
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in shm_names)


def test_kill_mid_call_raises_promptly_and_restart_works():
    kw = dict(tasks=("reach-v3",), cameras=("image",), image_size=224, max_steps=150)
    w = EnvWorker("metaworld", kw, index=7).start()
    try:
        w.reset_sync(0, 0)
        long_chunk = np.zeros((150, 4), np.float32)  # 150 rendered steps: many seconds

        async def call_and_kill():
            task = asyncio.ensure_future(w.execute(long_chunk, render_every_step=True, run_to_max_steps=True))
            await asyncio.sleep(0.5)
            assert not task.done()
            t0 = time.monotonic()
            w.kill()
            with pytest.raises(EnvWorkerCrashed) as ei:
                await task
            return time.monotonic() - t0, ei.value

        dt, err = asyncio.run(call_and_kill())
        assert dt < 5.0 and err.index == 7
        assert not w.alive
        with pytest.raises(EnvWorkerCrashed):
            w.reset_sync(0, 0)
        old = w.pid
        w.restart()
        assert w.alive and w.pid != old and w.loaded_task is None
        o = w.reset_sync(0, 1)
        assert o.images["image"].shape == (224, 224, 3)
    finally:
        pid = w.pid
        w.close()
    assert _gone(pid) and not w.alive


def test_image_buffers_of_a_killed_evaluation_are_swept_by_the_next_worker():
    """An evaluation killed with its whole process group (a CI timeout, `kill -9 -PGID`: the resource tracker that
    would unlink its shared memory dies with it) left each env's image buffer in /dev/shm for good (11 were found
    on this machine). The buffers' names carry the creating pid; the next worker to start removes those of dead
    processes."""
    import signal
    import subprocess
    import sys

    from wamkit.envs.worker import SHM_PREFIX

    code = ("import sys, time; from wamkit.envs.worker import EnvWorker; "
            f"w = EnvWorker('metaworld', dict(tasks=('reach-v3',), cameras=('image',), image_size=16, max_steps=5)); "
            "w.start(); print(w._shm.name, flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        name = p.stdout.readline().strip()
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    assert name.startswith(f"{SHM_PREFIX}{p.pid}_")
    path = os.path.join("/dev/shm", name)
    assert os.path.exists(path)                      # left behind: nothing that would unlink it is running
    w = EnvWorker("metaworld", dict(tasks=("reach-v3",), cameras=("image",), image_size=16, max_steps=5)).start()
    try:
        assert not os.path.exists(path)
        assert w._shm.name.startswith(f"{SHM_PREFIX}{os.getpid()}_")
    finally:
        w.close()
