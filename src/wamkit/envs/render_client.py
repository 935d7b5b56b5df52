"""renderer=shared, the env side: frames drawn by a shared render process (render_server.py) instead of a
mujoco.Renderer of the env's own. Same pixels (tests/test_shared_renderer.py), one GL context for every env.

`RenderClient(address).render(model_id, model, data, camera, height, width)` sends the frame's kinematics
(render_wire.py) and returns the RGB image. The env registers each model once with `model_id(model)` right after
building it (an MJB of the model as built, so every env process of a task sends the same bytes and the server holds
it once). A broken connection (the render process died and is being restarted) is retried for RECONNECT_S: a render
request is stateless, so asking again is safe. A service whose socket directory is gone (closed, or its render
processes left with their parent) restarts nothing: the request fails at once.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Client

import numpy as np

from wamkit.envs import render_wire as wire
from wamkit.envs.render_service import ADDRESS_PREFIX, key_for, resolve_renderer

RECONNECT_S = 60.0


def client_for(renderer: str, processes: int) -> "RenderClient | None":
    """An env's client for its `renderer` option: None for own; shared (an env built in this process: the
    service is started here) or a concrete unix:<socket> (an env worker: its parent chose it)."""
    if renderer == "own":
        return None
    address = resolve_renderer({"renderer": renderer, "render_processes": processes}, None, 0)["renderer"]
    return RenderClient(address)


class RenderServiceError(RuntimeError):
    """The shared renderer refused a request (its message says why) or stayed unreachable."""


def _require_ok(reply: dict) -> None:
    if not reply.get("ok"):
        raise RenderServiceError(f"shared renderer: {reply.get('error', reply)}")


class RenderClient:
    def __init__(self, address: str):
        self.address = address[len(ADDRESS_PREFIX):] if address.startswith(ADDRESS_PREFIX) else address
        self._conn = None
        self._mjb: dict[str, bytes] = {}
        self.requests = 0

    def model_id(self, model) -> str:
        """Register `model` (as it is now) and return its key."""
        import mujoco

        buf = np.empty(mujoco.mj_sizeModel(model), np.uint8)
        mujoco.mj_saveModel(model, None, buf)
        mjb = buf.tobytes()
        key = wire.model_key(mjb)
        self._mjb[key] = mjb
        return key

    def render(self, key: str, model, data, camera: str, height: int, width: int, *, option=None,
               max_geom: int = wire.DEFAULT_MAX_GEOM, flip: bool = True) -> np.ndarray:
        """The frame `camera` sees in (model, data), drawn with `option` (an MjvOption; None: MuJoCo's defaults) in a
        scene of `max_geom` geoms; rows top-down (flip, as mujoco.Renderer) or as OpenGL reads them (as robosuite)."""
        layout, payload = wire.pack_arrays(wire.frame_sources(model, data, option))
        head = {"op": "render", "key": key, "camera": camera, "size": [int(height), int(width)],
                "max_geom": int(max_geom), "flip": bool(flip), "arrays": layout}
        reply, pixels = self._call(head, payload)
        if reply.get("missing"):
            if key not in self._mjb:
                raise RenderServiceError(f"model {key} was never registered with model_id()")
            _require_ok(self._call({"op": "model", "key": key}, self._mjb[key])[0])
            reply, pixels = self._call(head, payload)
        _require_ok(reply)
        self.requests += 1
        return np.frombuffer(pixels, np.uint8).reshape(reply["shape"]).copy()

    def _call(self, head: dict, payload: bytes) -> tuple[dict, bytes]:
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                conn = self._connect()
                wire.send(conn, head, payload)
                reply = wire.recv_header(conn)
                pixels = conn.recv_bytes(wire.MAX_FRAME_PAYLOAD)
                break
            except (EOFError, OSError) as e:   # the render process died: it is being restarted, ask again
                self.close()
                if not os.path.isdir(os.path.dirname(self.address)):
                    raise RenderServiceError(f"shared renderer at {self.address} is gone (its service closed): "
                                             f"{e}") from None
                if time.monotonic() > deadline:
                    raise RenderServiceError(f"shared renderer at {self.address} unreachable for "
                                             f"{RECONNECT_S:.0f} s: {e}") from None
                time.sleep(0.1)
        return reply, pixels

    def _connect(self):
        if self._conn is None:
            self._conn = Client(self.address, family="AF_UNIX", authkey=key_for(self.address))
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
