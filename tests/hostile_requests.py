"""Hostile request bodies for the action API (issue 16), shared by tests/test_serve_hardening.py (in-process decode)
and tests/test_serve_fuzz.py (a real `wamkit serve`).

cases() -> list of Case(name, body bytes, content type, statuses accepted, path the error must name); every case
listed in the issue is here. mutate(rng, ...) -> a random corruption of a valid body (any status but 5xx)."""

from __future__ import annotations

import base64
import io
import json
import random
import struct
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

MP = "application/msgpack"
JS = "application/json"
SIDE = 16


@dataclass
class Case:
    name: str
    body: bytes
    content_type: str
    statuses: tuple[int, ...]      # accepted answers
    path: str | None = None        # the error's path must start with this (None: not checked)


def image(side: int = SIDE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def raw(img: np.ndarray) -> dict:
    return {"dtype": "uint8", "shape": list(img.shape), "bytes": img.tobytes()}


def raw_json(img: np.ndarray) -> dict:
    return {"dtype": "uint8", "shape": list(img.shape), "bytes": base64.b64encode(img.tobytes()).decode()}


def valid_body(seed: int = 0, binary: bool = True, n: int = 1) -> dict:
    """A valid request for a policy reading camera `image` and no state (e.g. `random`)."""
    enc = raw if binary else raw_json
    return {"request_id": f"ok-{seed}",
            "input": {"task": "pick", "image": [enc(image(SIDE, seed + i)) for i in range(n)]},
            "parameters": {"seed": [seed + i for i in range(n)]}}


def pack(obj, binary: bool) -> tuple[bytes, str]:
    if binary:
        return msgpack.packb(obj, use_bin_type=True), MP
    return json.dumps(obj).encode(), JS


def png_bytes(img: np.ndarray, **kw) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(img).save(b, format="PNG", **kw)
    return b.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(width: int, height: int, idat: bool = True) -> bytes:
    """A valid black RGB PNG of width x height, streamed through zlib row by row (never held decoded): 8192 x 8192
    compresses to about 196 KB and would decode to 201 MB (268 MB in PIL's RGBX)."""
    head = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    if not idat:
        return head + _chunk(b"IEND", b"")
    z = zlib.compressobj(9)
    row = b"\x00" * (1 + 3 * width)
    parts = [z.compress(row) for _ in range(height)]
    parts.append(z.flush())
    return head + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")


def other_format(fmt: str) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(image(8)).save(b, format=fmt)
    return b.getvalue()


def _with(binary: bool, **inp) -> dict:
    body = valid_body(binary=binary)
    body["input"].update(inp)
    return body


def _state_bytes(values, dtype="float32", shape=None) -> dict:
    a = np.asarray(values, dtype)
    return {"dtype": dtype, "shape": list(a.shape) if shape is None else shape, "bytes": a.tobytes()}


def _nest(depth: int, leaf=0):
    x = leaf
    for _ in range(depth):
        x = [x]
    return x


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name, obj, binary, statuses, path=None):
        body, ct = pack(obj, binary)
        out.append(Case(name, body, ct, tuple(statuses), path))

    # --- 3: nesting (JSON and msgpack), checked without recursion: 400 naming the field
    for binary in (False, True):
        tag = "mp" if binary else "json"
        add(f"{tag}_deep_image_200", _with(binary, image=_nest(200)), binary, (400,), "input.image")
        add(f"{tag}_deep_param", {**valid_body(binary=binary), "parameters": {"condition_frame_indexes": _nest(500)}},
            binary, (400,), "parameters.condition_frame_indexes")
    out.append(Case("json_deep_100k", b'{"input": {"image": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}", JS, (400,)))
    out.append(Case("mp_deep_5000", b"\x81\xa5input\x81\xa5image" + b"\x91" * 5000 + b"\x00", MP, (400,)))
    out.append(Case("mp_deep_1000", b"\x81\xa5input\x81\xa5image" + b"\x91" * 1000 + b"\x00", MP, (400,)))
    # --- 3: msgpack bytes keys, mixed str/bytes keys, keys that are not UTF-8
    ok = valid_body(binary=True)
    add("mp_bytes_keys_valid", {b"request_id": "b", b"input": {b"task": "t", b"image": [raw(image())]},
                                b"parameters": {b"seed": 3}}, True, (200,))
    add("mp_mixed_keys_duplicate", {**ok, "parameters": {"seed": 1, b"seed": 2}}, True, (400,), "parameters")
    add("mp_bytes_key_unknown", {**ok, "parameters": {b"sead": 1}}, True, (400,), "parameters.sead")
    add("mp_bytes_key_not_utf8", {**ok, "parameters": {b"\xff\xfe": 1}}, True, (400,), "parameters")
    add("mp_int_key", {**ok, "parameters": {7: 1}}, True, (400,), "parameters")
    # --- 3: huge integers
    big = int("9" * 400)
    out.append(Case("json_400_digit_state", json.dumps(_with(False, state=[[big] * 8])).encode(), JS, (400,),
                    "input.state"))
    out.append(Case("json_5000_digit_int", b'{"input": {"state": [' + b"9" * 5000 + b"]}}", JS, (400,)))
    add("json_huge_seed", {**valid_body(binary=False), "parameters": {"seed": 2 ** 70}}, False, (400,),
        "parameters.seed")
    add("json_huge_request_id", {**valid_body(binary=False), "request_id": 10 ** 30}, False, (400,), "request_id")
    add("negative_seed", {**valid_body(binary=True), "parameters": {"seed": -1}}, True, (400,), "parameters.seed")
    add("huge_horizon", {**valid_body(binary=True), "parameters": {"seed": 1, "action_horizon": 2 ** 40}}, True,
        (400,), "parameters.action_horizon")
    # --- 3: negative / 2**32 dims in {dtype, shape, bytes} arrays (state and images)
    for name, shape in (("neg", [-8]), ("2p32", [2 ** 32]), ("2p32x2p32", [2 ** 32, 2 ** 32]),
                        ("2p31x2p31", [2 ** 31 - 1, 2 ** 31 - 1]), ("rank5", [1, 1, 1, 1, 8]),
                        ("not_ints", ["8"]), ("dict", {"a": 1})):
        add(f"state_shape_{name}", _with(True, state=[_state_bytes([0.0] * 8, shape=shape)]), True, (400,),
            "input.state")
    for name, shape in (("neg", [-16, 16, 3]), ("zero", [0, 16, 3]), ("2p32", [2 ** 32, 16, 3]),
                        ("batch_2p40", [2 ** 40, 16, 16, 3]), ("side_9000", [9000, 16, 3]), ("rank2", [16, 48])):
        add(f"image_shape_{name}", _with(True, image={"dtype": "uint8", "shape": shape, "bytes": b"\0" * 768}), True,
            (400, 413), "input.image")
    for dtype in ("V8", "(2,)f4", "object", "O", "U8", "complex64", "float128", "M8", 7):
        add(f"state_dtype_{dtype}", _with(True, state=[{"dtype": dtype, "shape": [8], "bytes": b"\0" * 32}]), True,
            (400,), "input.state")
        add(f"image_dtype_{dtype}", _with(True, image={"dtype": dtype, "shape": [16, 16, 3], "bytes": b"\0" * 768}),
            True, (400,), "input.image")
    # --- 2/3: compressed images that declare huge sizes; formats other than PNG/JPEG; mutations
    for name, data, status in (("png_8192", png_bomb(8192, 8192), 413),
                               ("png_header_100k", png_bomb(100_000, 100_000, idat=False), 413),
                               ("png_header_30k", png_bomb(30_000, 30_000, idat=False), 413),
                               ("png_header_4097x4097", png_bomb(4097, 4097, idat=False), 413),
                               ("png_header_zero", png_bomb(0, 16, idat=False), 400)):
        add(f"{name}_b64", _with(False, image={"b64_json": base64.b64encode(data).decode()}), False, (status,),
            "input.image")
        add(f"{name}_mp_uri", _with(True, image="data:image/png;base64," + base64.b64encode(data).decode()), True,
            (status,), "input.image")
    for fmt in ("GIF", "TIFF", "JPEG2000", "DDS", "BMP", "WEBP", "ICO", "PPM", "QOI"):
        add(f"format_{fmt}", _with(False, image={"b64_json": base64.b64encode(other_format(fmt)).decode()}), False,
            (400,), "input.image")
    png16 = png_bytes(np.zeros((8, 8), np.uint16) + 300)
    add("png_16bit_gray", _with(False, image={"b64_json": base64.b64encode(png16).decode()}), False, (400,),
        "input.image")
    add("png_truncated", _with(False, image={"b64_json": base64.b64encode(png_bytes(image())[:60]).decode()}),
        False, (400,), "input.image")
    # --- 2: decoded bytes per request (the server under test sets max_decoded_mb; 64 x 2048^2 x 3 = 805 MB)
    many = base64.b64encode(png_bomb(2048, 2048)).decode()
    add("decoded_bytes_cap", _with(False, image=[{"b64_json": many}] * 64), False, (413,), "input.image")
    # --- 3: lone surrogates in task / request_id (JSON escapes); invalid UTF-8 in msgpack strings
    out.append(Case("json_surrogate_task", b'{"input": {"task": "a\\ud800b", "image": '
                    + json.dumps([raw_json(image())]).encode() + b'}}', JS, (400,), "input.task"))
    out.append(Case("json_surrogate_request_id", b'{"request_id": "\\udfff", "input": {"image": '
                    + json.dumps([raw_json(image())]).encode() + b'}}', JS, (400,), "request_id"))
    out.append(Case("mp_invalid_utf8_str", msgpack.packb({"input": {"task": "x"}}).replace(b"\xa1x", b"\xa1\xff"),
                    MP, (400,)))
    # --- 4: non-finite values, JSON NaN, float64 overflowing float32
    nan_state = _with(True, state=[_state_bytes([0, 1, float("nan"), 3, 4, 5, 6, 7])])
    add("state_bytes_nan", nan_state, True, (400,), "input.state")
    add("state_bytes_f64_inf", _with(True, state=[_state_bytes([0, float("inf")], "float64")]), True, (400,),
        "input.state")
    add("state_1e300", _with(True, state=[[1e300] * 8]), True, (400,), "input.state")
    add("state_f64_bytes_1e300", _with(True, state=[_state_bytes([1e300] * 8, "float64")]), True, (400,),
        "input.state")
    for lit in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):
        out.append(Case(f"json_literal_{lit.decode()}", b'{"input": {"state": [[1.0, ' + lit + b']]}}', JS, (400,),
                        "input.state"))
    add("mp_nan_param", {**valid_body(binary=True), "parameters": {"seed": 1, "guidance_scale": float("nan")}},
        True, (400,), "parameters.guidance_scale")
    add("state_strings", _with(True, state=[["nan"] * 8]), True, (400,), "input.state")
    # --- 11: msgpack extension types, timestamps (type -1) included
    add("mp_timestamp", {**valid_body(binary=True), "request_id": msgpack.Timestamp(1, 0)}, True, (400,),
        "request_id")
    out.append(Case("mp_ext_5", msgpack.packb({"input": msgpack.ExtType(5, b"x")}), MP, (400,)))
    out.append(Case("mp_ext_minus1_bad", b"\x81\xa5input\xc7\x03\xffxyz", MP, (400,)))
    # --- other shapes of garbage
    out.append(Case("empty_body_json", b"", JS, (400,)))
    out.append(Case("empty_body_mp", b"", MP, (400,)))
    out.append(Case("top_level_list", b"[1, 2]", JS, (400,)))
    out.append(Case("text_plain", b"hello", "text/plain", (415,)))
    out.append(Case("pickle", b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94.", "application/python-pickle",
                    (415,)))
    add("long_task", _with(True, task="x" * 20_000), True, (400,), "input.task")
    add("ragged_state", _with(True, state=[[1.0, [2.0]]]), True, (400,), "input.state")
    add("bool_state", _with(True, state=[[True] * 8]), True, (400,), "input.state")
    add("image_list_bools", _with(True, image=[[[[True, False, True]] * 4] * 4]), True, (400,), "input.image")
    add("image_values_overflow", _with(False, image={"values": [[[2 ** 63, 0, 0]]], "dtype": "uint8"}), False,
        (400,), "input.image")
    add("request_id_bool", {**valid_body(binary=True), "request_id": True}, True, (400,), "request_id")
    add("b64_raw_too_long", _with(False, image={"dtype": "uint8", "shape": [16, 16, 3], "bytes": "A" * 4000}),
        False, (400,), "input.image")
    add("ndarray_marker_neg", _with(True, image={"__ndarray__": True, "data": b"\0" * 768, "dtype": "|u1",
                                                 "shape": [-16, -16, 3]}), True, (400,), "input.image")
    add("param_list_too_long", {**valid_body(binary=True), "parameters": {"seed": 1,
                                                                         "condition_frame_indexes": [0] * 5000}},
        True, (400,), "parameters.condition_frame_indexes")
    add("param_nested_dict", {**valid_body(binary=True), "parameters": {"seed": 1, "use_guardrails": {"a": [1]}}},
        True, (400,), "parameters.use_guardrails")
    add("too_many_observations", _with(True, image=[raw(image(1))] * 5000), True, (413,), "input.image")
    add("too_many_states", _with(True, state=[[0.0]] * 5000), True, (400,), "input.state")
    return out


# ----------------------------------------------------------------------------------------------- random mutation
_JUNK = [None, True, -1, 0, 2 ** 63, -(2 ** 63) - 1, 1e308, -0.0, "", "x" * 100, "\u0000", [], {}, [[[]]],
         {"__ndarray__": True}, {"dtype": "uint8"}, {"b64_json": "AAAA"}, b"\x00\xff", [1, "a", None], {"": ""}]


def _junk(rng: random.Random, binary: bool):
    j = rng.choice(_JUNK)
    if not binary and isinstance(j, bytes):
        return j.decode("latin-1")
    if isinstance(j, int) and not binary and abs(j) > 2 ** 64:
        return j
    if isinstance(j, int) and binary and not -(2 ** 63) <= j < 2 ** 64:
        return -1
    return j


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def mutate(rng: random.Random, binary: bool) -> tuple[bytes, str]:
    """One random corruption of a valid body: a structural edit (replace / delete / wrap a value) or byte-level damage
    (flip, truncate, insert) of the encoded body."""
    body = valid_body(rng.randrange(1000), binary, n=rng.randint(1, 3))
    body["input"]["state"] = [[rng.uniform(-1, 1) for _ in range(8)] for _ in body["input"]["image"]]
    kind = rng.random()
    if kind < 0.6:
        paths = [p for p in _paths(body) if p]
        for _ in range(rng.randint(1, 3)):
            p = rng.choice(paths)
            parent = body
            try:
                for k in p[:-1]:
                    parent = parent[k]
                op = rng.random()
                if op < 0.6:
                    parent[p[-1]] = _junk(rng, binary)
                elif op < 0.8 and isinstance(parent, dict):
                    parent.pop(p[-1], None)
                else:
                    parent[p[-1]] = [parent[p[-1]]] if rng.random() < 0.5 else {"x": parent[p[-1]]}
            except (KeyError, IndexError, TypeError):
                pass
        return pack(body, binary)
    data, ct = pack(body, binary)
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.random()
        if op < 0.5 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.7 and b:
            del b[rng.randrange(len(b)):]
        else:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(b), ct
