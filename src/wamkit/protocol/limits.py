"""Decode limits of the action API: what one request may make the server build in memory. The server fills them from
ServeConfig; the defaults here are what any decoder gets unless it asks for others (listed in docs/serving.md,
"Limits and security")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from wamkit.protocol.errors import ProtocolError

MAX_SIDE = 8192                  # no image side may exceed this, whatever the pixel cap
MAX_DIM = 2 ** 31 - 1            # any declared array dimension
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 64 - 1   # integers anywhere in a body (what msgpack can carry)
MAX_DTYPE_CHARS = 32             # a dtype string from the network ('<f4', 'uint8'); numpy parses long ones slowly


def parse_dtype(dtype: str) -> np.dtype:
    """np.dtype of a dtype string from the network; ValueError for one longer than MAX_DTYPE_CHARS (numpy took
    seconds, holding the GIL, over a multi-MB structured-dtype string) or one numpy does not know."""
    if len(dtype) > MAX_DTYPE_CHARS:
        raise ValueError(f"a dtype string of {len(dtype)} characters (at most {MAX_DTYPE_CHARS})")
    try:
        return np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as e:   # numpy parses some strings as Python (SyntaxError)
        raise ValueError(str(e)) from None


@dataclass(frozen=True)
class DecodeLimits:
    max_depth: int = 32                          # nesting of mappings/lists in a body (an image as lists needs ~7)
    max_image_pixels: int = 4096 * 4096          # per image, checked on the declared size before any decoding
    max_decoded_bytes: int = 256 * 1024 * 1024   # all images of one request, decoded to uint8 (H, W, 3)
    max_text_chars: int = 16384                  # each task/prompt string and the request_id
    max_observations: int = 1024                 # observations in one request (the server: its max_queue)
    max_param_items: int = 1024                  # items of a list-valued parameter (condition_frame_indexes)
    max_containers: int = 2 ** 20                # mappings + lists in one body (numbers not counted): ~20 images of
                                                 # 224x224 as nested pixel lists; raw bytes/PNG/array markers: a few


def check_count(n: int, limits: DecodeLimits, path: str) -> None:
    """Refuse more observations than limits.max_observations before any of them is decoded (413)."""
    if n > limits.max_observations:
        raise ProtocolError(path, f"{n} observations in one request; at most {limits.max_observations}", status=413)


class ImageBudget:
    """Decoded image bytes left for one request: take() before building an array, 413 when it would overflow.
    shared: what the bytes are also taken from, past the request (a server's budget over every request it holds:
    an object with take(nbytes), which raises when they do not fit)."""

    def __init__(self, limits: DecodeLimits, shared: Any = None):
        self.limits = limits
        self.shared = shared
        self.used = 0

    def take(self, nbytes: int, path: str) -> None:
        if self.used + nbytes > self.limits.max_decoded_bytes:
            raise ProtocolError(path, f"the request's images would decode to more than "
                                      f"{self.limits.max_decoded_bytes} bytes (server max_decoded_mb)", status=413)
        if self.shared is not None:
            self.shared.take(nbytes)
        self.used += nbytes

    def check_pixels(self, h: int, w: int, path: str) -> None:
        if h * w > self.limits.max_image_pixels:
            raise ProtocolError(path, f"image of {w}x{h} = {h * w} pixels exceeds the cap of "
                                      f"{self.limits.max_image_pixels} pixels per image (server max_image_pixels)",
                                status=413)
