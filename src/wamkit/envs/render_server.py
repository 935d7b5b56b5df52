"""One shared render process (renderer=shared; started and restarted by render_service.py): every env's frames in
ONE OpenGL context, instead of a context per env process and task.

Why: on a GPU that also runs the model, 31 env processes rendering in their own GL contexts made the server's batch
of 16 take 226 ms instead of 22; physics plus one process rendering even more frames in one context, 49 ms
(docs/benchmarks.md 3). The frames are the same pixels (tests/test_shared_renderer.py): the env sends the kinematics
its own renderer would have drawn (render_wire.py), the server holds each task's model once (loaded from the env's
MJB) and draws them.

The loop: a thread accepts connections (authenticated with the service's key); the main thread, which owns the GL
context, serves whichever connection has a request, one request at a time. A bad request gets an error reply naming
what is wrong and the server keeps serving; a client that goes away is dropped. A render process whose parent (the
service's process) died without closing it (SIGKILL, os._exit) removes the service's socket directory and exits
within PARENT_CHECK_S: no orphan holding a GL context and the models' memory.
"""

from __future__ import annotations

import os
import tempfile
import threading
import traceback
from collections import OrderedDict
from multiprocessing.connection import Listener
from multiprocessing.connection import wait as mp_wait

import numpy as np

from wamkit.envs import render_wire as wire

GL_CONTEXT_SIDE = 64     # the context's own surface; frames are drawn into each model's offscreen framebuffer
MAX_GEOM = 10000         # scene capacity, as mujoco.Renderer's default
MAX_MODELS = 64         # models held at once; the least recently drawn one is freed beyond (asked again if needed)
PAYLOAD_WAIT_S = 10.0    # a request's payload frame follows its header at once; longer: the client is dropped
PARENT_CHECK_S = 1.0     # how often an idle render process checks that its parent is still there


class _Scene:
    """One model's state in the server: its MjData (overwritten by every request), MjrContext, visual options, and
    a scene per capacity asked for."""

    def __init__(self, mujoco, model):
        self.model, self.data = model, mujoco.MjData(model)
        self.scenes: dict[int, object] = {}
        self.option = mujoco.MjvOption()
        self.ctx = mujoco.MjrContext(model, mujoco.mjtFontScale.mjFONTSCALE_150.value)
        self.ctx.readDepthMap = mujoco.mjtDepthMap.mjDEPTH_ZEROFAR
        self.expected = dict(wire.frame_sources(model, self.data, self.option))

    def scene(self, mujoco, max_geom: int):
        if max_geom not in self.scenes:
            self.scenes[max_geom] = mujoco.MjvScene(self.model, maxgeom=max_geom)
        return self.scenes[max_geom]


class RenderServer:
    def __init__(self, mujoco):
        self.mj = mujoco
        self.scenes: OrderedDict[str, _Scene] = OrderedDict()
        self.default_option = mujoco.MjvOption()

    def load(self, head: dict, payload: bytes) -> dict:
        key = head.get("key")
        if not isinstance(key, str) or wire.model_key(payload) != key:
            return {"ok": False, "error": "model: key must be the first 32 hex digits of the MJB's sha256"}
        if key not in self.scenes:
            with tempfile.NamedTemporaryFile(suffix=".mjb") as f:
                f.write(payload)
                f.flush()
                try:
                    model = self.mj.MjModel.from_binary_path(f.name)
                except Exception as e:  # noqa: BLE001 - a bad MJB is the client's error
                    return {"ok": False, "error": f"model: not a loadable MJB: {e}"[:300]}
            self.scenes[key] = _Scene(self.mj, model)   # its offscreen buffer as the model sets it, as the env's
            while len(self.scenes) > MAX_MODELS:
                self.scenes.popitem(last=False)[1].ctx.free()
        return {"ok": True}

    def render(self, head: dict, payload: bytes) -> tuple[dict, bytes]:
        mj = self.mj
        s = self.scenes.get(head.get("key"))
        if s is None:
            return {"ok": False, "missing": True}, b""
        self.scenes.move_to_end(head["key"])
        h, w = wire.check_size(head.get("size"))
        g = s.model.vis.global_
        if w > g.offwidth or h > g.offheight:   # mujoco.Renderer refuses these too
            return {"ok": False, "error": f"size: {h}x{w} is over this model's offscreen buffer "
                                          f"({g.offheight}x{g.offwidth}: its visual/global offheight, offwidth)"}, b""
        cam = head.get("camera")
        cam_id = mj.mj_name2id(s.model, mj.mjtObj.mjOBJ_CAMERA, cam) if isinstance(cam, str) else -1
        if cam_id < 0:
            return {"ok": False, "error": f"camera: no camera {cam!r} in this model"[:200]}, b""
        scene = s.scene(mj, wire.check_max_geom(head.get("max_geom", wire.DEFAULT_MAX_GEOM)))
        flip = head.get("flip", True)
        if not isinstance(flip, bool):
            raise ValueError(f"flip must be true or false, got {flip!r}"[:200])
        sent = wire.unpack_arrays(head.get("arrays"), payload, s.expected)
        for f in wire.OPTION_FIELDS:   # MuJoCo's defaults unless sent (another client's must not stay)
            getattr(s.option, f)[...] = getattr(self.default_option, f)
        for name, arr in sent:
            s.expected[name][...] = arr
        camera = mj.MjvCamera()
        camera.type, camera.fixedcamid = mj.mjtCamera.mjCAMERA_FIXED, cam_id
        mj.mjv_updateScene(s.model, s.data, s.option, None, camera, mj.mjtCatBit.mjCAT_ALL.value, scene)
        rect = mj.MjrRect(0, 0, w, h)
        mj.mjr_setBuffer(mj.mjtFramebuffer.mjFB_OFFSCREEN.value, s.ctx)
        mj.mjr_render(rect, scene, s.ctx)
        out = np.empty((h, w, 3), np.uint8)
        mj.mjr_readPixels(out, None, rect, s.ctx)
        return {"ok": True, "shape": [h, w, 3]}, np.ascontiguousarray(out[::-1] if flip else out).reshape(-1).data

    def handle(self, conn) -> None:
        """Answer one request from conn (a reply always goes back, an error one for a bad request)."""
        try:
            head = wire.recv_header(conn)
            op = head.get("op")
            limit = wire.MAX_MODEL if op == "model" else wire.MAX_FRAME_PAYLOAD
            if not conn.poll(PAYLOAD_WAIT_S):   # a client stopped between its two frames must not stall the others
                raise ValueError(f"no payload within {PAYLOAD_WAIT_S:.0f} s of the header")
            payload = conn.recv_bytes(limit)
        except (ValueError, OSError) as e:   # OSError: a frame over its cap (the connection is then out of step)
            wire.send(conn, {"ok": False, "error": str(e)[:300]})
            raise ConnectionResetError("request dropped") from e
        try:
            if op == "model":
                wire.send(conn, self.load(head, payload))
            elif op == "render":
                reply, pixels = self.render(head, payload)
                wire.send(conn, reply, pixels)
            else:
                wire.send(conn, {"ok": False, "error": f"op must be model or render, got {op!r}"[:200]})
        except ValueError as e:
            wire.send(conn, {"ok": False, "error": str(e)})
        except Exception as e:  # noqa: BLE001 - one bad request must not take the server down
            wire.send(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
            traceback.print_exc()


def serve(address: str, authkey: bytes, gl: dict[str, str | None], ready=None) -> None:
    """The render process's body (render_service.py spawns it): GL selected by `gl` before mujoco is imported."""
    for k, v in gl.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    parent = os.getppid()
    import mujoco

    ctx = mujoco.GLContext(GL_CONTEXT_SIDE, GL_CONTEXT_SIDE)
    ctx.make_current()
    server = RenderServer(mujoco)
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    pending, lock = [], threading.Lock()
    wake_r, wake_w = os.pipe()

    def accept() -> None:
        while True:
            try:
                c = listener.accept()
            except Exception:  # noqa: BLE001 - a failed handshake (wrong key) refuses that client only
                continue
            with lock:
                pending.append(c)
            os.write(wake_w, b"x")

    threading.Thread(target=accept, name="render-accept", daemon=True).start()
    if ready is not None:
        ready.send(os.getpid())
        ready.close()
    conns: list = []
    while True:
        readable = mp_wait(conns + [wake_r], timeout=PARENT_CHECK_S)
        if os.getppid() != parent:   # reparented: the service's process is gone
            _orphaned(address)
        for c in readable:
            if c == wake_r:
                os.read(wake_r, 4096)
                with lock:
                    conns += pending
                    pending.clear()
                continue
            try:
                server.handle(c)
            except (EOFError, OSError):
                conns.remove(c)
                c.close()


def _orphaned(address: str) -> None:
    """Leave without a parent: remove the service's private directory (sockets, key file; the other render processes
    of the service may race to do the same) and exit at once, skipping GL teardown at interpreter exit."""
    import shutil

    shutil.rmtree(os.path.dirname(address), ignore_errors=True)
    os._exit(0)
