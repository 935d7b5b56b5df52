"""Body codecs: JSON and msgpack (content-type ``application/msgpack``). Never unpickles; the top level must be a
mapping. Every decoded body is then checked in one pass (check_tree, no recursion) so later code only ever sees plain
data: nesting <= max_depth, str keys (msgpack bytes keys are decoded as UTF-8), integers in -2**63..2**64-1, finite
floats (JSON NaN/Infinity and overflowing literals refused), strings that are valid Unicode (no lone surrogates), and
no msgpack extension types (timestamps included). Each refusal is a 400 naming the field path.

numpy scalars packed by openpi's and SGLang's msgpack packers (``{"__npgeneric__": True, "data": 7, "dtype": "<i8"}``,
keys as str or bytes: what ``seed=np.int64(7)`` becomes) are replaced by the Python scalar (bool, int or float) they
carry, in the same pass."""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import numpy as np

from wamkit.protocol.errors import ProtocolError
from wamkit.protocol.limits import INT_MAX, INT_MIN, DecodeLimits, parse_dtype

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


def field_path(parts: tuple) -> str:
    """("input", "image", 3, "shape") -> "input.image[3].shape"."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def _key_text(k: Any, parts: tuple) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, (bytes, bytearray)):
        try:
            return bytes(k).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(field_path(parts), "a mapping key is not valid UTF-8") from None
    raise ProtocolError(field_path(parts), f"mapping keys must be strings, got {type(k).__name__}")


def _check_leaf(v: Any, parts: tuple) -> None:
    t = type(v)
    if t is str:
        if not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ProtocolError(field_path(parts), "string is not valid Unicode (lone surrogate)") from None
    elif t is int:
        if not INT_MIN <= v <= INT_MAX:
            raise ProtocolError(field_path(parts), "integer out of range (-2**63..2**64-1)")
    elif t is float:
        if not math.isfinite(v):
            raise ProtocolError(field_path(parts), f"numbers must be finite, got {v}")
    elif t is bytes or t is bool or v is None:
        pass
    elif isinstance(v, (msgpack.Timestamp, msgpack.ExtType)):
        code = -1 if isinstance(v, msgpack.Timestamp) else v.code
        raise ProtocolError(field_path(parts), f"msgpack extension type {code} is not accepted")
    else:
        raise ProtocolError(field_path(parts), f"unsupported value of type {t.__name__}")


def _marker_get(d: dict, key: str) -> Any:
    return d[key] if key in d else d.get(key.encode())


def _is_npgeneric(v: dict) -> bool:
    return bool(_marker_get(v, "__npgeneric__"))


def _npgeneric_value(v: dict, parts: tuple) -> Any:
    """A numpy-scalar marker -> the bool / int / float it carries (400 naming the field when it is not one)."""
    data, dtype = _marker_get(v, "data"), _marker_get(v, "dtype")
    if isinstance(dtype, (bytes, bytearray)):
        dtype = bytes(dtype).decode("ascii", "replace")
    try:
        kind = parse_dtype(dtype).kind if isinstance(dtype, str) else None
    except ValueError:
        kind = None
    want = {"b": (bool,), "i": (int,), "u": (int,), "f": (int, float)}.get(kind or "")
    if want is None or type(data) not in want:
        raise ProtocolError(field_path(parts), f"a numpy scalar must carry a bool, int or float of its dtype, got "
                                               f"dtype {str(dtype)[:20]!r} and {type(data).__name__}")
    value = float(data) if kind == "f" else data
    _check_leaf(value, parts)
    return value


def check_tree(obj: Any, max_depth: int = DecodeLimits.max_depth) -> None:
    """One iterative pass over a decoded body (see the module doc). Rewrites bytes keys as str and numpy-scalar
    markers as Python scalars, in place."""
    stack: list[tuple[Any, tuple, int]] = [(obj, (), 1)]
    while stack:
        node, parts, depth = stack.pop()
        if depth > max_depth:
            raise ProtocolError(field_path(parts), f"nested deeper than {max_depth} levels")
        if type(node) is dict:
            if not all(type(k) is str for k in node):
                items = [(_key_text(k, parts), v) for k, v in node.items()]
                if len({k for k, _ in items}) != len(items):
                    raise ProtocolError(field_path(parts), "duplicate mapping keys (str and bytes spellings)")
                node.clear()
                node.update(items)
            scalars = []
            for k, v in node.items():
                t = type(v)
                if t is dict and _is_npgeneric(v):
                    scalars.append((k, _npgeneric_value(v, parts + (k,))))
                elif t is dict or t is list:
                    stack.append((v, parts + (k,), depth + 1))
                else:
                    _check_leaf(v, parts + (k,))
            node.update(scalars)
        elif type(node) is list:
            inner_ok = depth + 1 <= max_depth
            for i, v in enumerate(node):
                t = type(v)
                if t is list:
                    if inner_ok:   # fast path for flat number lists (a pixel [r, g, b], a state vector)
                        for x in v:
                            tx = type(x)
                            if not ((tx is int and INT_MIN <= x <= INT_MAX) or (tx is float and x - x == 0.0)):
                                break   # a container or a bad leaf: the full walk below finds and names it
                        else:
                            continue
                    stack.append((v, parts + (i,), depth + 1))
                elif t is dict:
                    if _is_npgeneric(v):
                        node[i] = _npgeneric_value(v, parts + (i,))
                    else:
                        stack.append((v, parts + (i,), depth + 1))
                elif t is int and INT_MIN <= v <= INT_MAX:
                    continue
                else:
                    _check_leaf(v, parts + (i,))
        else:
            _check_leaf(node, parts)


def decode_body(body: bytes, content_type: str | None, max_depth: int = DecodeLimits.max_depth) -> dict[str, Any]:
    """Request/response bytes -> dict. msgpack when the content type says so, JSON otherwise; then check_tree."""
    if is_msgpack(content_type):
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_refuse_ext)
        except ProtocolError:
            raise
        except msgpack.StackError:
            raise ProtocolError("", f"body is nested deeper than {max_depth} levels") from None
        except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
            why = str(e)[:200] or "a byte that begins no msgpack value"   # FormatError says nothing (0xc1)
            raise ProtocolError("", f"body is not valid msgpack ({type(e).__name__}: {why})") from None
    else:
        ct = (content_type or "").lower()
        if ct and "json" not in ct:
            raise ProtocolError("", f"unsupported content-type {content_type!r}; use application/json or "
                                    f"{MSGPACK}", status=415)
        try:
            obj = json.loads(body)
        except RecursionError:
            raise ProtocolError("", f"body is nested deeper than {max_depth} levels") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError("", f"body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("", f"body must be a mapping, got {type(obj).__name__}")
    check_tree(obj, max_depth)
    return obj


def encode_body(obj: dict[str, Any], binary: bool) -> tuple[bytes, str]:
    """dict -> (bytes, content type). binary=True: msgpack with bin type for bytes; else compact JSON."""
    if binary:
        return msgpack.packb(obj, use_bin_type=True, default=_np_default), MSGPACK
    return json.dumps(obj, separators=(",", ":"), default=_np_default).encode(), JSON
