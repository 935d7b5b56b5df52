"""Encoded images whose data ends early are refused (docs/serving.md: truncated files are a 400), while every valid
PNG layout still decodes to its exact pixels: interlaced, a last row of zeros, gray, palette, 1-bit, RGBA."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from wamkit.protocol import ProtocolError
from wamkit.protocol.images import decode_image
from wamkit.protocol.limits import DecodeLimits, ImageBudget

ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_rgb(w: int, h: int, idat: bytes, interlace: int = 0) -> bytes:
    """An 8-bit RGB PNG with the given (already compressed) IDAT data."""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, interlace)) +
            _chunk(b"IDAT", idat) + _chunk(b"IEND", b""))


def scanlines(a: np.ndarray, interlace: bool = False) -> bytes:
    """The filtered (filter 0) rows of an (H, W, 3) image, in Adam7 pass order when interlaced."""
    passes = ADAM7 if interlace else ((0, 0, 1, 1),)
    return b"".join(b"\0" + row.tobytes() for x0, y0, dx, dy in passes for row in a[y0::dy, x0::dx] if row.size)


def decode(raw: bytes) -> np.ndarray:
    return decode_image({"b64_json": base64.b64encode(raw).decode()}, "input.image", budget=ImageBudget(DecodeLimits()))


def saved(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_a_zlib_stream_that_ends_before_the_last_row_is_refused():
    """PIL (13) accepts a complete zlib stream holding fewer rows than the header declares and zero-fills the rest."""
    a = np.full((64, 64, 3), 200, np.uint8)
    rows = scanlines(a)
    assert (decode(png_rgb(64, 64, zlib.compress(rows))) == a).all()
    for kept in (3, 63):    # rows in the stream
        with pytest.raises(ProtocolError, match="truncated") as e:
            decode(png_rgb(64, 64, zlib.compress(rows[: kept * (1 + 64 * 3)])))
        assert e.value.path == "input.image.b64_json" and e.value.status == 400
    padded = zlib.compress(rows[: 3 * (1 + 64 * 3)]) + b"\0" * 20000   # enough bytes, still too few rows
    with pytest.raises(ProtocolError, match="truncated"):
        decode(png_rgb(64, 64, padded))


def test_a_large_header_with_a_few_bytes_of_data_is_refused_before_decoding(monkeypatch):
    """4096 x 4000 (within max_image_pixels) with ~100 bytes of IDAT: refused from the chunk sizes alone (deflate
    cannot expand ~100 bytes into 49 MB of rows), before PIL allocates or decodes anything."""
    w, h = 4096, 4000
    raw = png_rgb(w, h, zlib.compress(b"\0" * (1 + w * 3), 9))
    assert len(raw) < 200
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded a truncated image"))
    with pytest.raises(ProtocolError, match="truncated"):
        decode(raw)


def test_valid_pngs_of_every_layout_still_decode_exactly():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (37, 29, 3), dtype=np.uint8)
    a[-1] = 0                                                     # a last row of zeros: the slow path
    assert (decode(saved(Image.fromarray(a))) == a).all()
    for shape in ((37, 29, 3), (5, 3, 3), (1, 1, 3)):             # interlaced (Adam7)
        b = rng.integers(0, 256, shape, dtype=np.uint8)
        rows = scanlines(b, interlace=True)
        assert (decode(png_rgb(shape[1], shape[0], zlib.compress(rows), interlace=1)) == b).all()
        if shape[0] > 1:
            with pytest.raises(ProtocolError):
                decode(png_rgb(shape[1], shape[0], zlib.compress(rows[:-(1 + shape[1] * 3)]), interlace=1))
    zeros = np.zeros((4000, 512, 3), np.uint8)                     # compressed ~1000:1, nearly deflate's limit
    assert (decode(png_rgb(512, 4000, zlib.compress(scanlines(zeros), 9))) == 0).all()
    gray = rng.integers(0, 256, (9, 7), dtype=np.uint8)
    for img in (Image.fromarray(gray), Image.fromarray(gray).convert("1"), Image.fromarray(a).convert("P"),
                Image.fromarray(np.zeros((9, 7, 4), np.uint8))):
        assert (decode(saved(img)) == np.asarray(img.convert("RGB"))).all(), img.mode
