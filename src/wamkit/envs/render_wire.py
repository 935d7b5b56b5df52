"""The shared renderer's wire format (renderer=shared: render_service.py starts the processes, render_server.py is
their loop, render_client.py the env side): its one place.

A message is two `send_bytes` frames on a multiprocessing connection over a Unix socket (HMAC-authenticated with the
service's key): a JSON header, then one binary payload (possibly empty). Nothing is ever unpickled.

- `{"op": "model", "key": K}` + an MJB (MuJoCo's binary model, `mj_saveModel`): the server loads it under K, the
  first 32 hex digits of the MJB's sha256 (checked). Reply `{"ok": true}`.
- `{"op": "render", "key": K, "camera": NAME, "size": [H, W], "max_geom": N, "flip": true, "arrays": [[field,
  dtype, shape], ...]}` + the arrays' bytes back to back: FRAME_FIELDS of the env's MjData (what mjv_updateScene
  reads: the kinematics the env's own renderer would draw, not the physics state, which an mj_step leaves one
  substep ahead of them), MODEL_FIELDS of its MjModel (looks an env may change per episode) and OPTION_FIELDS of the
  MjvOption its renderer draws with (prefixed `opt.`; robosuite hides collision geoms through them). `max_geom` is
  the scene's capacity (mujoco.Renderer 10000, robosuite 1000: a scene over it drops geoms, so it must match) and
  `flip` whether rows come top-down as mujoco.Renderer returns them (true) or as OpenGL reads them (false, as
  robosuite). Reply `{"ok": true, "shape": [H, W, 3]}` + the RGB pixels (uint8), or `{"ok": false, "missing":
  true}` (send the model, then ask again), or `{"ok": false, "error": WHY}` (the request was wrong; the server keeps
  serving).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

# MjData fields that mjv_updateScene reads for the default visual options (bodies, geoms, sites, cameras, lights,
# tendons, flexes); fields of size 0 in a model are left out of its requests.
FRAME_FIELDS = ("xpos", "xmat", "xquat", "xipos", "ximat", "geom_xpos", "geom_xmat", "site_xpos", "site_xmat",
                "cam_xpos", "cam_xmat", "light_xpos", "light_xdir", "subtree_com", "ten_wrapadr", "ten_wrapnum",
                "ten_length", "wrap_obj", "wrap_xpos", "flexvert_xpos", "qpos", "mocap_pos", "mocap_quat")
# MjModel fields an env may change between episodes that change pixels (colours and sizes; poses come as FRAME_FIELDS)
MODEL_FIELDS = ("geom_rgba", "geom_size", "site_rgba", "site_size", "mat_rgba")
# MjvOption fields (uint8 arrays) sent as `opt.<field>`
OPTION_FIELDS = ("geomgroup", "sitegroup", "jointgroup", "tendongroup", "actuatorgroup", "flexgroup", "skingroup",
                 "flags")
OPTION_PREFIX = "opt."
DEFAULT_MAX_GEOM = 10000      # mujoco.Renderer's
MAX_MAX_GEOM = 100000
MAX_HEADER = 1 << 16          # bytes of one JSON header
MAX_FRAME_PAYLOAD = 64 << 20  # bytes of one render request's arrays
MAX_MODEL = 1 << 30           # bytes of one MJB
MAX_SIDE = 4096               # largest image side served
KEY_HEX = 32


def model_key(mjb: bytes) -> str:
    return hashlib.sha256(mjb).hexdigest()[:KEY_HEX]


def send(conn, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    conn.send_bytes(json.dumps(header, separators=(",", ":")).encode())
    conn.send_bytes(payload)


def recv_header(conn) -> dict[str, Any]:
    """The next JSON header (a dict); ValueError naming what is wrong otherwise. OSError if it is over MAX_HEADER."""
    raw = conn.recv_bytes(MAX_HEADER)
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not JSON: {e}") from None
    if not isinstance(head, dict):
        raise ValueError("header must be a JSON object")
    return head


def pack_arrays(sources: list[tuple[str, np.ndarray]]) -> tuple[list[list[Any]], bytes]:
    """([[name, dtype, shape], ...], their bytes back to back) for a render request."""
    layout, parts = [], []
    for name, a in sources:
        a = np.ascontiguousarray(a)
        layout.append([name, a.dtype.str, list(a.shape)])
        parts.append(a.tobytes())
    return layout, b"".join(parts)


def unpack_arrays(layout: Any, payload: bytes, expected: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """The arrays of a render request, each checked against `expected` (the server model's own array of that name:
    the same dtype and shape) and the payload's size; ValueError naming the first field that is wrong."""
    if not isinstance(layout, list):
        raise ValueError("arrays must be a list of [field, dtype, shape]")
    out, off = [], 0
    for item in layout:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
            raise ValueError(f"arrays: each entry is [field, dtype, shape], got {item!r}"[:200])
        name, dtype, shape = item
        ref = expected.get(name)
        if ref is None:
            raise ValueError(f"arrays: unknown field {name!r}; valid: {', '.join(sorted(expected))}")
        if dtype != ref.dtype.str or list(shape) != list(ref.shape):
            raise ValueError(f"arrays: field {name!r} must be {ref.dtype.str} {list(ref.shape)} for this model, "
                             f"got {dtype} {shape}"[:300])
        n = ref.nbytes
        if off + n > len(payload):
            raise ValueError(f"arrays: payload ends inside field {name!r} ({len(payload)} bytes)")
        out.append((name, np.frombuffer(payload, ref.dtype, ref.size, off).reshape(ref.shape)))
        off += n
    if off != len(payload):
        raise ValueError(f"arrays: payload has {len(payload) - off} bytes after the last field")
    return out


def frame_sources(model, data, option=None) -> list[tuple[str, np.ndarray]]:
    """What a render request carries for this model (its non-empty FRAME_FIELDS and MODEL_FIELDS) and, given the
    MjvOption the env's renderer uses, its OPTION_FIELDS."""
    out = [(f, getattr(data, f)) for f in FRAME_FIELDS if getattr(data, f).size]
    out += [(f, getattr(model, f)) for f in MODEL_FIELDS if getattr(model, f).size]
    if option is not None:
        out += [(OPTION_PREFIX + f, getattr(option, f)) for f in OPTION_FIELDS]
    return out


def check_max_geom(n: Any) -> int:
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_MAX_GEOM):
        raise ValueError(f"max_geom must be an integer 1..{MAX_MAX_GEOM}, got {n!r}"[:200])
    return n


def check_size(size: Any) -> tuple[int, int]:
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) and 0 < s <= MAX_SIDE
                                                              for s in size)):
        raise ValueError(f"size must be [height, width], each 1..{MAX_SIDE}, got {size!r}"[:200])
    return size[0], size[1]
