"""renderer=shared on the real simulator and real render processes: the same pixels as each env's own renderer, a
server that answers bad requests with errors and keeps serving, refuses a wrong key, and comes back after a crash
without losing a frame."""

from __future__ import annotations

import os
import signal
import stat
import time
from multiprocessing.connection import Client
from pathlib import Path

import numpy as np
import pytest
from processes import running

pytestmark = [pytest.mark.slow, pytest.mark.metaworld]
pytest.importorskip("metaworld")

TASKS = ("drawer-open-v3", "pick-place-v3", "door-open-v3")   # drawer/door move bodies per episode (body_pos)
KW = dict(tasks=TASKS, image_size=64, cameras=("image", "wrist_image"), render_quality="fast", max_steps=30)


@pytest.fixture(scope="module")
def pair():
    from wamkit.envs.metaworld import MetaWorldEnv

    own, shared = MetaWorldEnv(**KW), MetaWorldEnv(renderer="shared", **KW)
    yield own, shared
    own.close()
    shared.close()


def _same(a, b, where):
    for cam in a.images:
        diff = np.abs(a.images[cam].astype(int) - b.images[cam]).max()
        assert np.array_equal(a.images[cam], b.images[cam]), f"{where} {cam}: max pixel difference {diff}"


def test_same_pixels_as_each_envs_own_renderer(pair):
    """Frames after resets and after chunks of physics (an mj_step leaves the drawn kinematics a substep behind the
    state: the env sends what its own renderer would draw), both cameras (the gripper's moves with the arm)."""
    own, shared = pair
    rng = np.random.default_rng(0)
    frames = 0
    for task in range(len(TASKS)):
        for trial in (0, 7):
            a, b = own.reset(task, trial), shared.reset(task, trial)
            _same(a, b, f"task {task} trial {trial} reset")
            for k in range(3):
                acts = rng.uniform(-1, 1, (5, 4)).astype(np.float32)
                ra, rb = own.execute(acts), shared.execute(acts)
                _same(ra.obs, rb.obs, f"task {task} trial {trial} chunk {k}")
                frames += 2
    assert frames == 36 and shared._client.requests >= 36 + 12
    assert shared._renderers == {}     # no GL context of its own: every frame came from the render process
    # episodes changed the scene between trials: the frames are not all one picture
    assert not np.array_equal(own.reset(0, 0).images["image"], own.reset(0, 7).images["image"])


def _service():
    from wamkit.envs.render_service import current_gl, shared_service

    return shared_service(current_gl(), 1)


def test_bad_requests_get_errors_and_the_server_keeps_serving(pair):
    from wamkit.envs import render_wire as wire
    from wamkit.envs.render_service import key_for

    own, shared = pair
    shared.reset(0, 0)
    addr = _service().address(0)
    key = shared._model_keys[0]

    def ask(head, payload=b""):
        c = Client(addr, family="AF_UNIX", authkey=key_for(addr))
        try:
            wire.send(c, head, payload)
            return wire.recv_header(c)
        finally:
            c.close()

    assert "op must be model or render" in ask({"op": "explode"})["error"]
    assert ask({"op": "render", "key": "0" * 32})["missing"] is True
    assert "key must be" in ask({"op": "model", "key": key}, b"not an mjb")["error"]
    assert "camera" in ask({"op": "render", "key": key, "camera": "nope", "size": [8, 8], "arrays": []})["error"]
    assert "size" in ask({"op": "render", "key": key, "camera": "corner2", "size": [0, 8], "arrays": []})["error"]
    assert "offscreen buffer" in ask({"op": "render", "key": key, "camera": "corner2", "size": [2000, 2000],
                                      "arrays": []})["error"]
    bad = ask({"op": "render", "key": key, "camera": "corner2", "size": [8, 8], "arrays": [["xpos", "<f8", [1, 3]]]},
              b"\0" * 24)
    assert "field 'xpos' must be" in bad["error"]
    assert "unknown field" in ask({"op": "render", "key": key, "camera": "corner2", "size": [8, 8],
                                   "arrays": [["qvel", "<f8", [1]]]}, b"\0" * 8)["error"]
    c = Client(addr, family="AF_UNIX", authkey=key_for(addr))
    c.send_bytes(b"{not json")
    assert "not JSON" in wire.recv_header(c)["error"]
    c.close()
    # and it still serves the real thing, the same pixels
    _same(own.reset(0, 0), shared.reset(0, 0), "after the bad requests")


def test_private_socket_dir_and_a_wrong_key_is_refused(pair):
    from multiprocessing import AuthenticationError

    from wamkit.envs.render_service import KEY_FILE

    svc = _service()
    assert stat.S_IMODE(os.stat(svc.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(Path(svc.dir) / KEY_FILE).st_mode) == 0o600
    with pytest.raises(AuthenticationError):
        Client(svc.address(0), family="AF_UNIX", authkey=b"guess")
    own, shared = pair
    _same(own.reset(1, 2), shared.reset(1, 2), "after the refused client")


def test_killed_render_process_is_restarted_and_the_frame_comes(pair):
    own, shared = pair
    svc = _service()
    shared.reset(2, 1)
    before, pid = svc.restarts, svc.pids()[0]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while svc.pids()[0] == pid and time.monotonic() < deadline:   # the next request may also meet it dead
        time.sleep(0.05)
    acts = np.zeros((4, 4), np.float32)
    own.reset(2, 1)
    _same(own.execute(acts).obs, shared.execute(acts).obs, "after a crash of the render process")
    assert svc.restarts == before + 1 and svc.pids()[0] != pid


def test_renderer_options_are_checked():
    from wamkit.core.errors import ConfigError
    from wamkit.envs.metaworld import MetaWorldEnv

    with pytest.raises(ConfigError, match="renderer must be one of own, shared"):
        MetaWorldEnv(renderer="gpu", **KW)
    with pytest.raises(ConfigError, match="render_processes must be >= 1"):
        MetaWorldEnv(renderer="shared", render_processes=0, **KW)


def test_env_workers_spread_over_the_render_processes():
    from wamkit.envs.metaworld import MetaWorldEnv
    from wamkit.envs.render_backend import worker_kwargs

    kw = {"renderer": "shared", "render_processes": 2, "render_backend": "egl"}
    addrs = [worker_kwargs(MetaWorldEnv, kw, i)["renderer"] for i in range(4)]
    assert all(a.startswith("unix:") for a in addrs)
    assert addrs[0] == addrs[2] != addrs[1] == addrs[3]
    assert worker_kwargs(MetaWorldEnv, {"render_backend": "egl"}, 0).get("renderer", "own") == "own"


def test_options_capacity_and_row_order_travel_with_the_request(pair):
    """What robosuite draws differently from mujoco.Renderer: its MjvOption (collision geoms hidden), a scene of
    1000 geoms (a smaller capacity drops geoms, so the server must use the same), rows as OpenGL reads them."""
    import mujoco

    own, shared = pair
    shared.reset(1, 3)
    env, key, client = shared._envs[1], shared._model_keys[1], shared._client
    opt = mujoco.MjvOption()
    opt.geomgroup[:] = [0, 1, 1, 0, 1, 1]      # hide groups 0 and 3
    for max_geom in (10000, 40):               # 40: fewer than the scene's geoms, some dropped
        ref = mujoco.Renderer(env.model, 64, 64, max_geom=max_geom)
        try:
            ref.update_scene(env.data, camera="corner2", scene_option=opt)
            want = ref.render()
        finally:
            ref.close()
        got = client.render(key, env.model, env.data, "corner2", 64, 64, option=opt, max_geom=max_geom, flip=False)
        assert np.array_equal(got[::-1], want), max_geom
    ref = mujoco.Renderer(env.model, 64, 64)
    try:
        ref.update_scene(env.data, camera="corner2")
        plain = ref.render()
    finally:
        ref.close()
    default = client.render(key, env.model, env.data, "corner2", 64, 64)
    assert not np.array_equal(plain, want)    # the options mattered
    assert np.array_equal(default, plain)     # and did not stay for the next request, which sent none


def test_least_recently_drawn_model_is_freed_beyond_the_cap(pair, monkeypatch):
    """The server holds at most MAX_MODELS models (LIBERO compiles a new one at each hard reset); beyond, the least
    recently drawn is freed, and a request for it is answered 'missing' (the client sends it again)."""
    import mujoco

    from wamkit.envs import render_server as rs
    from wamkit.envs.render_wire import frame_sources, pack_arrays

    _, shared = pair
    for t in range(3):
        shared.reset(t, 0)
    monkeypatch.setattr(rs, "MAX_MODELS", 2)
    gl = mujoco.GLContext(64, 64)
    gl.make_current()
    try:
        server = rs.RenderServer(mujoco)
        keys = [shared._model_keys[t] for t in range(3)]

        def draw(t):
            e = shared._envs[t]
            layout, payload = pack_arrays(frame_sources(e.model, e.data))
            return server.render({"key": keys[t], "camera": "corner2", "size": [16, 16], "arrays": layout},
                                 payload)[0]

        for t in (0, 1):
            assert server.load({"key": keys[t]}, shared._client._mjb[keys[t]])["ok"]
        assert draw(0)["ok"]                               # 0 drawn last: 1 is the least recently drawn
        assert server.load({"key": keys[2]}, shared._client._mjb[keys[2]])["ok"]
        assert list(server.scenes) == [keys[0], keys[2]]
        assert draw(1) == {"ok": False, "missing": True} and draw(0)["ok"] and draw(2)["ok"]
    finally:
        gl.free()


def test_a_client_that_stops_after_its_header_is_dropped(monkeypatch):
    """A header without its payload (the client stopped between its two frames) gets an error and the connection
    is dropped after PAYLOAD_WAIT_S, instead of the server waiting for it while every other env waits too."""
    import mujoco
    from multiprocessing import Pipe

    from wamkit.envs import render_server as rs
    from wamkit.envs import render_wire as wire

    monkeypatch.setattr(rs, "PAYLOAD_WAIT_S", 0.2)
    server_end, client_end = Pipe()
    client_end.send_bytes(b'{"op": "render", "key": "x"}')
    with pytest.raises(ConnectionResetError):
        rs.RenderServer(mujoco).handle(server_end)
    assert "no payload within" in wire.recv_header(client_end)["error"]


def test_render_processes_leave_when_their_parent_is_killed():
    """A process that started a service and dies without closing it (SIGKILL: no atexit) leaves no render process
    behind, and no socket directory with its key file."""
    import subprocess
    import sys

    from wamkit.envs.render_server import PARENT_CHECK_S

    code = ("import os, sys, time\n"
            "from wamkit.envs.render_service import RenderService, current_gl\n"
            "svc = RenderService(current_gl(), 2)\n"
            "print(svc.dir, *svc.pids(), flush=True)\n"
            "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert len(line) == 3, f"the service did not start: {line}"
        sockdir, pids = Path(line[0]), [int(x) for x in line[1:]]
        assert sockdir.is_dir() and all(map(running, pids))
        time.sleep(2 * PARENT_CHECK_S)
        assert all(map(running, pids))   # a living parent keeps them
        p.kill()
        p.wait(10)
        deadline = time.monotonic() + 10 * PARENT_CHECK_S + 5
        while any(map(running, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(running, pids)), f"render processes {pids} outlived their parent"
        assert not sockdir.exists()
    finally:
        p.kill()
        p.wait(10)


def test_a_client_of_a_closed_service_fails_at_once(tmp_path, monkeypatch):
    """No socket directory: nothing will restart the render process, so the request fails at its first attempt
    instead of retrying for RECONNECT_S (an env worker mid-step whose evaluation was killed then leaves at once)."""
    from wamkit.envs import render_client as rc

    waits = []
    monkeypatch.setattr(rc.time, "sleep", waits.append)   # each retry waits first
    client = rc.RenderClient(f"unix:{tmp_path / 'closed' / 'render-0.sock'}")
    with pytest.raises(rc.RenderServiceError, match="is gone"):
        client._call({"op": "render"}, b"")
    assert waits == []
