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

Limits (wamkit.protocol.limits): every image's side <= MAX_SIDE and pixels <= max_image_pixels, checked on the declared
shape or (PNG/JPEG) on the header before any pixel is decoded; the request's decoded bytes are counted against
max_decoded_bytes (ImageBudget). Encoded images must be PNG or JPEG.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from wamkit.protocol.errors import ProtocolError, public_text
from wamkit.protocol.limits import MAX_SIDE, DecodeLimits, ImageBudget, parse_dtype

ENCODED_FORMATS = ("PNG", "JPEG")           # the only encoded image formats decoded (PIL is asked for no other)
_PNG_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA")   # 8-bit modes: at most 4 bytes a pixel before RGB
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
        dt = parse_dtype(dtype)
    except ValueError:
        raise ProtocolError(path + ".dtype", f"unknown dtype {dtype[:40]!r}") from None
    if dt != np.uint8:
        raise ProtocolError(path + ".dtype", f"images must be uint8, got {dtype!r}")


def _check_shape(shape: Any, path: str, allow_batch: bool, budget: ImageBudget) -> tuple[int, ...]:
    """A declared image shape -> tuple; refuses bad ranks, sides outside 1..MAX_SIDE and images over the pixel cap."""
    if not isinstance(shape, (list, tuple)) or len(shape) > 4 or \
            not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise ProtocolError(path + ".shape", f"expected a list of ints, got {str(shape)[:80]}")
    shape = tuple(shape)
    ok3 = len(shape) == 3 and shape[2] == 3
    ok4 = allow_batch and len(shape) == 4 and shape[3] == 3
    if not (ok3 or ok4):
        want = "[H, W, 3]" + (" or [N, H, W, 3]" if allow_batch else "")
        raise ProtocolError(path + ".shape", f"expected {want}, got {list(shape)}")
    if any(s <= 0 for s in shape) or shape[-2] > MAX_SIDE or shape[-3] > MAX_SIDE:
        raise ProtocolError(path + ".shape", f"image sides must be in 1..{MAX_SIDE}, got {list(shape)}")
    budget.check_pixels(shape[-3], shape[-2], path + ".shape")
    return shape


def _from_buffer(buf: Any, shape: tuple[int, ...], path: str, field: str, budget: ImageBudget) -> np.ndarray:
    n = math.prod(shape)  # python ints: no overflow, whatever the declared batch size
    budget.take(n, path)
    if isinstance(buf, str):  # JSON transport of the raw form: base64 text
        if len(buf) > 4 * (n // 3 + 1) + 4:
            raise ProtocolError(f"{path}.{field}", f"base64 text too long for shape {list(shape)}")
        try:
            buf = base64.b64decode(buf, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"{path}.{field}", "expected raw bytes or base64 text") from None
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{path}.{field}", f"expected raw bytes, got {type(buf).__name__}")
    if len(buf) != n:
        raise ProtocolError(f"{path}.{field}", f"has {len(buf)} bytes but shape {list(shape)} needs {n}")
    return np.frombuffer(buf, np.uint8).reshape(shape)


def _from_lists(values: Any, path: str, allow_batch: bool, budget: ImageBudget) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        raise ProtocolError(path, "nested image lists are ragged or hold non-integers") from None
    if arr.dtype.kind not in "iu":
        raise ProtocolError(path, f"nested image lists must hold integers in 0..255, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ProtocolError(path, "pixel values must be in 0..255")
    _check_shape(list(arr.shape), path, allow_batch, budget)
    budget.take(arr.size, path)
    return arr.astype(np.uint8)


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}     # color type -> samples per pixel
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_MAX_DEFLATE_RATIO = 1032 + 64   # deflate never expands by more than ~1032x (258-byte matches in 2 bits), + slack
_TRUNCATED = "truncated image data (the PNG's compressed data ends before its last row)"


@dataclass
class _PngLayout:
    scanline_bytes: int          # what the IDAT stream must inflate to: every row (of every Adam7 pass) + filter byte
    interlaced: bool
    idat: list[memoryview]       # the IDAT chunks' data, in order
    idat_bytes: int


def _png_layout(raw: bytes) -> _PngLayout | None:
    """The IHDR's scanline size and the IDAT chunks of a PNG, from its chunk headers (no decompression); None when
    they cannot be read (PIL then refuses the file itself)."""
    if len(raw) < 33 or raw[12:16] != b"IHDR":
        return None
    w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", raw[16:29])
    bits = _PNG_CHANNELS.get(ctype, 4) * depth
    passes = _ADAM7 if interlace == 1 else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        cols, rows = -(-(w - x0) // dx) if w > x0 else 0, -(-(h - y0) // dy) if h > y0 else 0
        if cols and rows:
            total += rows * (1 + -(-cols * bits // 8))
    view, idat, pos = memoryview(raw), [], 8
    while pos + 8 <= len(raw):
        n, kind = struct.unpack(">I4s", raw[pos:pos + 8])
        if kind == b"IDAT":
            idat.append(view[pos + 8:pos + 8 + n])
        elif kind == b"IEND":
            break
        pos += 12 + n
    return _PngLayout(total, interlace == 1, idat, sum(len(c) for c in idat))


def _png_rows_complete(im: Any, png: _PngLayout) -> bool:
    """Did PIL's decoder reach the last row? PIL (13) accepts a zlib stream that ends cleanly before the last row and
    leaves the missing rows zero. Fast path: a non-interlaced image whose last row holds a non-zero byte was decoded
    to its end (rows come in order into a zeroed image). Otherwise (an interlaced image, a last row of zeros) the IDAT
    stream is inflated once more, in bounded pieces, and must yield every scanline."""
    h = im.size[1]
    if not png.interlaced and im.crop((0, h - 1, im.size[0], h)).tobytes().strip(b"\0"):
        return True
    z, got = zlib.decompressobj(), 0
    try:
        for chunk in png.idat:
            for i in range(0, len(chunk), 1 << 16):
                data = chunk[i:i + (1 << 16)]
                while data and got < png.scanline_bytes:
                    got += len(z.decompress(data, 1 << 20))
                    data = z.unconsumed_tail
                if got >= png.scanline_bytes or z.eof:
                    return got >= png.scanline_bytes
    except zlib.error:
        return False
    return got >= png.scanline_bytes


def _from_encoded(data: Any, path: str, budget: ImageBudget) -> np.ndarray:
    """base64/bytes PNG or JPEG -> (H, W, 3). The header is read first (PIL opens lazily): format, mode and declared
    size are checked, and the decoded bytes taken from the budget, before a single pixel is decoded."""
    from PIL import Image

    if isinstance(data, (bytes, bytearray)):
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
    if not (raw.startswith(b"\x89PNG\r\n\x1a\n") or raw.startswith(b"\xff\xd8\xff")):
        raise ProtocolError(path, "not a PNG or JPEG image (other formats are refused: send PNG, JPEG or raw uint8)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # DecompressionBombWarning: our own caps below are tighter
            with Image.open(io.BytesIO(raw), formats=ENCODED_FORMATS) as im:
                if im.format not in ENCODED_FORMATS:
                    raise ProtocolError(path, f"image format {im.format} is not accepted; send PNG or JPEG")
                w, h = im.size
                if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE):
                    raise ProtocolError(path, f"image sides must be in 1..{MAX_SIDE}, header declares {w}x{h}",
                                        status=413)
                budget.check_pixels(h, w, path)
                if im.format == "PNG" and im.mode not in _PNG_MODES:
                    raise ProtocolError(path, f"PNG mode {im.mode} is not accepted; send 8-bit gray/RGB/RGBA")
                png = _png_layout(raw) if im.format == "PNG" else None
                if png is not None and png.idat_bytes * _MAX_DEFLATE_RATIO < png.scanline_bytes:
                    raise ProtocolError(path, _TRUNCATED)    # too few bytes to hold the rows: refused before decoding
                budget.take(h * w * 3, path)
                im.load()
                if png is not None and not _png_rows_complete(im, png):
                    raise ProtocolError(path, _TRUNCATED)
                arr = np.asarray(im.convert("RGB"))
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - hostile bytes make PIL raise many types; all mean "not a valid image"
        if type(e).__name__ == "DecompressionBombError":
            raise ProtocolError(path, f"image too large to decode: {e}", status=413) from None
        why = "its header is not one PIL reads" if type(e).__name__ == "UnidentifiedImageError" else \
            public_text(str(e)[:120])   # (never the object repr PIL puts in its text, nor a path)
        raise ProtocolError(path, f"not a decodable PNG/JPEG image ({type(e).__name__}: {why})") from None
    if arr.shape != (h, w, 3):
        raise ProtocolError(path, f"decoded to shape {list(arr.shape)}, header declared {w}x{h}")
    return arr


def decode_image(value: Any, path: str, allow_batch: bool = False, budget: ImageBudget | None = None) -> np.ndarray:
    """One image payload -> uint8 (H, W, 3) (or (N, H, W, 3) when allow_batch and a batch was sent). `budget`: the
    request's decoded-bytes budget (default: a fresh one with the default DecodeLimits)."""
    budget = budget if budget is not None else ImageBudget(DecodeLimits())
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise ProtocolError(path + ".dtype", f"images must be uint8, got {value.dtype}")
        _check_shape(list(value.shape), path, allow_batch, budget)
        budget.take(value.size, path)
        return value
    if isinstance(value, dict):
        if _get(value, "__ndarray__") is not None:
            _check_dtype(_get(value, "dtype"), path)
            shape = _check_shape(_as_list(_get(value, "shape")), path, allow_batch, budget)
            return _from_buffer(_get(value, "data"), shape, path, "data", budget)
        if "bytes" in value:
            _expect_keys(value, {"bytes", "dtype", "shape"}, path)
            _check_dtype(value.get("dtype", "uint8"), path)
            shape = _check_shape(value.get("shape"), path, allow_batch, budget)
            return _from_buffer(value["bytes"], shape, path, "bytes", budget)
        if "values" in value or "data" in value:
            key = "values" if "values" in value else "data"
            _expect_keys(value, {key, "dtype", "shape"}, path)
            if "dtype" in value:
                _check_dtype(value["dtype"], path)
            vals = value[key]
            if "shape" in value:
                shape = _check_shape(value["shape"], path, allow_batch, budget)
                if isinstance(vals, (bytes, bytearray)):
                    return _from_buffer(vals, shape, path, key, budget)
                arr = _from_lists(vals, f"{path}.{key}", True, budget)
                if arr.size != math.prod(shape):
                    raise ProtocolError(path + ".shape", f"{list(shape)} does not match {arr.size} values")
                return arr.reshape(shape)
            return _from_lists(vals, f"{path}.{key}", allow_batch, budget)
        if "b64_json" in value or "base64" in value:
            key = "b64_json" if "b64_json" in value else "base64"
            _expect_keys(value, {key}, path)
            return _from_encoded(value[key], f"{path}.{key}", budget)
        raise ProtocolError(path, "unknown image form; expected one of {dtype, shape, bytes}, {values, dtype, shape}, "
                                  "{b64_json}, a data URI or nested uint8 lists")
    if isinstance(value, str):
        if value.startswith("data:"):
            return _from_encoded(value, path, budget)
        raise ProtocolError(path, "image strings must be data URIs; file paths and URLs are not read by this server")
    if isinstance(value, list):
        return _from_lists(value, path, allow_batch, budget)
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
