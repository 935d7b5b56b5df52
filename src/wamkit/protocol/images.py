"""Image payloads of the action API: decode any accepted form to uint8 arrays, encode arrays to a chosen form.

Accepted forms (decode_image), fastest first:
- raw       ``{"dtype": "uint8", "shape": [H, W, 3], "bytes": <bin>}``      wamkit fast path (msgpack bin; in JSON
            ``bytes`` may be a base64 string). ``shape`` may be ``[N, H, W, 3]`` where a batch is allowed.
- ndarray   ``{"__ndarray__": true, "data": <bin>, "dtype": "|u1", "shape": [...]}``  SGLang's msgpack array marker
            (keys may arrive as str or bytes).
- values    ``{"values": <nested lists>, "dtype": "uint8", "shape": [H, W, 3]}``   SGLang's tensor payload.
- b64_json  ``{"b64_json": "<base64 PNG/JPEG>"}`` (also ``base64``; a data URI inside is fine).
- data URI  ``"data:image/png;base64,...."``
- lists     nested uint8 lists ``[[[r, g, b], ...], ...]`` (``image.tolist()``).
File paths and URLs are refused: the server never reads files or fetches anything on a client's behalf.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from wamkit.protocol.errors import ProtocolError

MAX_SIDE = 8192
ENCODINGS = ("raw", "ndarray", "values", "png", "data_uri", "list")


def _get(d: dict, key: str, default: Any = None) -> Any:
    """dict lookup that also finds bytes keys (SGLang's msgpack array marker packs its keys as bytes)."""
    if key in d:
        return d[key]
    return d.get(key.encode(), default)


def _check_dtype(dtype: Any, path: str) -> None:
    if isinstance(dtype, bytes):
        dtype = dtype.decode("ascii", "replace")
    if not isinstance(dtype, str):
        raise ProtocolError(path + ".dtype", f"expected a dtype string, got {type(dtype).__name__}")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ProtocolError(path + ".dtype", f"unknown dtype {dtype!r}") from None
    if dt != np.uint8:
        raise ProtocolError(path + ".dtype", f"images must be uint8, got {dtype!r}")


def _check_shape(shape: Any, path: str, allow_batch: bool) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                       for s in shape):
        raise ProtocolError(path + ".shape", f"expected a list of ints, got {shape!r}")
    shape = tuple(shape)
    ok3 = len(shape) == 3 and shape[2] == 3
    ok4 = allow_batch and len(shape) == 4 and shape[3] == 3
    if not (ok3 or ok4):
        want = "[H, W, 3]" + (" or [N, H, W, 3]" if allow_batch else "")
        raise ProtocolError(path + ".shape", f"expected {want}, got {list(shape)}")
    if any(s <= 0 for s in shape) or shape[-2] > MAX_SIDE or shape[-3] > MAX_SIDE:
        raise ProtocolError(path + ".shape", f"image sides must be in 1..{MAX_SIDE}, got {list(shape)}")
    return shape


def _from_buffer(buf: Any, shape: tuple[int, ...], path: str, field: str) -> np.ndarray:
    if isinstance(buf, str):  # JSON transport of the raw form: base64 text
        try:
            buf = base64.b64decode(buf, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"{path}.{field}", "expected raw bytes or base64 text") from None
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{path}.{field}", f"expected raw bytes, got {type(buf).__name__}")
    n = int(np.prod(shape))
    if len(buf) != n:
        raise ProtocolError(f"{path}.{field}", f"has {len(buf)} bytes but shape {list(shape)} needs {n}")
    return np.frombuffer(buf, np.uint8).reshape(shape)


def _from_lists(values: Any, path: str, allow_batch: bool) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):
        raise ProtocolError(path, "nested image lists are ragged") from None
    if arr.dtype.kind not in "iu":
        raise ProtocolError(path, f"nested image lists must hold integers in 0..255, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ProtocolError(path, "pixel values must be in 0..255")
    _check_shape(list(arr.shape), path, allow_batch)
    return arr.astype(np.uint8)


def _from_encoded(data: Any, path: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, bytes):
        raw = data
    else:
        if not isinstance(data, str):
            raise ProtocolError(path, f"expected base64 text, got {type(data).__name__}")
        if data.startswith("data:"):
            if "," not in data:
                raise ProtocolError(path, "malformed data URI")
            data = data.split(",", 1)[1]
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(path, "invalid base64") from None
    try:
        with Image.open(io.BytesIO(raw)) as im:
            if im.width > MAX_SIDE or im.height > MAX_SIDE:
                raise ProtocolError(path, f"image sides must be <= {MAX_SIDE}")
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ProtocolError(path, f"cannot decode image: {e}") from None


def decode_image(value: Any, path: str, allow_batch: bool = False) -> np.ndarray:
    """One image payload -> uint8 (H, W, 3) (or (N, H, W, 3) when allow_batch and a batch was sent)."""
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise ProtocolError(path + ".dtype", f"images must be uint8, got {value.dtype}")
        _check_shape(list(value.shape), path, allow_batch)
        return value
    if isinstance(value, dict):
        if _get(value, "__ndarray__") is not None:
            _check_dtype(_get(value, "dtype"), path)
            shape = _check_shape(_as_list(_get(value, "shape")), path, allow_batch)
            return _from_buffer(_get(value, "data"), shape, path, "data")
        if "bytes" in value:
            _expect_keys(value, {"bytes", "dtype", "shape"}, path)
            _check_dtype(value.get("dtype", "uint8"), path)
            shape = _check_shape(value.get("shape"), path, allow_batch)
            return _from_buffer(value["bytes"], shape, path, "bytes")
        if "values" in value or "data" in value:
            key = "values" if "values" in value else "data"
            _expect_keys(value, {key, "dtype", "shape"}, path)
            if "dtype" in value:
                _check_dtype(value["dtype"], path)
            vals = value[key]
            if "shape" in value:
                shape = _check_shape(value["shape"], path, allow_batch)
                if isinstance(vals, (bytes, bytearray)):
                    return _from_buffer(vals, shape, path, key)
                arr = _from_lists(vals, f"{path}.{key}", allow_batch=True)
                if arr.size != int(np.prod(shape)):
                    raise ProtocolError(path + ".shape", f"{list(shape)} does not match {arr.size} values")
                return arr.reshape(shape)
            return _from_lists(vals, f"{path}.{key}", allow_batch)
        if "b64_json" in value or "base64" in value:
            key = "b64_json" if "b64_json" in value else "base64"
            _expect_keys(value, {key}, path)
            return _from_encoded(value[key], f"{path}.{key}")
        raise ProtocolError(path, "unknown image form; expected one of {dtype, shape, bytes}, {values, dtype, shape}, "
                                  "{b64_json}, a data URI or nested uint8 lists")
    if isinstance(value, str):
        if value.startswith("data:"):
            return _from_encoded(value, path)
        raise ProtocolError(path, "image strings must be data URIs; file paths and URLs are not read by this server")
    if isinstance(value, list):
        return _from_lists(value, path, allow_batch)
    raise ProtocolError(path, f"expected an image, got {type(value).__name__}")


def _as_list(x: Any) -> Any:
    return list(x) if isinstance(x, tuple) else x


def _expect_keys(d: dict, allowed: set[str], path: str) -> None:
    for k in d:
        if k not in allowed:
            raise ProtocolError(f"{path}.{k}", f"unknown field; expected only {sorted(allowed)}")


def encode_image(img: np.ndarray, encoding: str = "raw", png_compress_level: int = 1) -> Any:
    """uint8 (H, W, 3) -> payload. encoding: raw (msgpack fast path), ndarray (SGLang msgpack marker), values,
    png ({b64_json}), data_uri, list."""
    img = np.ascontiguousarray(img)
    if img.dtype != np.uint8:
        raise ProtocolError("image.dtype", f"images must be uint8, got {img.dtype}")
    if encoding == "raw":
        return {"dtype": "uint8", "shape": list(img.shape), "bytes": img.tobytes()}
    if encoding == "ndarray":
        return {"__ndarray__": True, "data": img.tobytes(), "dtype": "|u1", "shape": list(img.shape)}
    if encoding == "values":
        return {"values": img.tolist(), "dtype": "uint8", "shape": list(img.shape)}
    if encoding == "list":
        return img.tolist()
    if encoding in ("png", "data_uri"):
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG", compress_level=png_compress_level)
        b64 = base64.b64encode(buf.getvalue()).decode("ascii")
        return {"b64_json": b64} if encoding == "png" else "data:image/png;base64," + b64
    raise ValueError(f"unknown image encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
