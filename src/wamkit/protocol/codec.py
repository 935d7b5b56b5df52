"""Body codecs: JSON and msgpack (content-type ``application/msgpack``). Never unpickles; msgpack ext types are
refused; the top level must be a mapping."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import numpy as np

from wamkit.protocol.errors import ProtocolError

MSGPACK = "application/msgpack"
JSON = "application/json"


def is_msgpack(content_type: str | None) -> bool:
    return "msgpack" in (content_type or "").lower()


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("", f"msgpack extension type {code} is not accepted")


def _np_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def decode_body(body: bytes, content_type: str | None) -> dict[str, Any]:
    """Request/response bytes -> dict. msgpack when the content type says so, JSON otherwise."""
    if is_msgpack(content_type):
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
        except ProtocolError:
            raise
        except Exception as e:  # msgpack raises several types (ExtraData, FormatError, StackError, ValueError...)
            raise ProtocolError("", f"body is not valid msgpack ({type(e).__name__}: {e})") from None
    else:
        ct = (content_type or "").lower()
        if ct and "json" not in ct:
            raise ProtocolError("", f"unsupported content-type {content_type!r}; use application/json or "
                                    f"{MSGPACK}", status=415)
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError("", f"body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("", f"body must be a mapping, got {type(obj).__name__}")
    return obj


def encode_body(obj: dict[str, Any], binary: bool) -> tuple[bytes, str]:
    """dict -> (bytes, content type). binary=True: msgpack with bin type for bytes; else compact JSON."""
    if binary:
        return msgpack.packb(obj, use_bin_type=True, default=_np_default), MSGPACK
    return json.dumps(obj, separators=(",", ":"), default=_np_default).encode(), JSON
