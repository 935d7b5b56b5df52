"""Body codecs: JSON and msgpack. Never unpickles; the top level must be a mapping.

The content type is matched exactly (media type before any ``;`` parameter, any case): ``application/json``, or
``application/msgpack`` (also ``application/x-msgpack`` and ``application/vnd.msgpack``); anything else, a missing
header included, is a 415 naming the header (``text/plain`` and an empty type are what a browser page may send to any
origin without asking it first).

Before a tree is built, its mappings and lists are counted against max_containers (413 beyond): msgpack counts them
as it builds them (its hooks run once per container and stop it at the limit), JSON is pre-scanned (brackets outside
strings). An empty map is one byte of msgpack and ~70 bytes of Python, so a body within max_body_mb could otherwise
build gigabytes of them; numbers and strings are not counted (their size is bounded by the body's).

Every decoded body is then checked in one pass (check_tree, no recursion) so later code only ever sees plain
data: nesting <= max_depth, str keys (msgpack bytes keys are decoded as UTF-8), integers in -2**63..2**64-1, finite
floats (JSON NaN/Infinity and overflowing literals refused), strings that are valid Unicode (no lone surrogates), and
no msgpack extension types (timestamps included). Each refusal is a 400 naming the field path (built only then).

numpy scalars packed by openpi's and SGLang's msgpack packers (``{"__npgeneric__": True, "data": 7, "dtype": "<i8"}``,
keys as str or bytes: what ``seed=np.int64(7)`` becomes) are replaced by the Python scalar (bool, int or float) they
carry, in the same pass."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgpack
import numpy as np

from wamkit.protocol.errors import ProtocolError
from wamkit.protocol.limits import INT_MAX, INT_MIN, DecodeLimits, parse_dtype

MSGPACK = "application/msgpack"
JSON = "application/json"
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")   # the spellings msgpack goes by


def media_type(content_type: str | None) -> str:
    """'Application/JSON; charset=utf-8' -> 'application/json' ('' for a missing header)."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_msgpack(content_type: str | None) -> bool:
    return media_type(content_type) in MSGPACK_TYPES


def check_content_type(content_type: str | None) -> None:
    """415 (naming the header) unless the content type is JSON or msgpack, matched exactly."""
    if is_msgpack(content_type) or media_type(content_type) == JSON:
        return
    got = f"content-type {content_type[:100]!r}" if content_type else "a missing content-type header"
    raise ProtocolError("", f"{got} is not accepted; send content-type {JSON} or {MSGPACK}", status=415)


def _too_many_containers(limit: int) -> ProtocolError:
    return ProtocolError("", f"body holds more than {limit} mappings/lists (server max_containers)", status=413)


class _ContainerCount:
    """msgpack's object_hook and list_hook: counts each mapping and list as it is built, refusing past the limit."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int):
        self.left = self.limit = limit

    def __call__(self, obj: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _too_many_containers(self.limit)
        return obj


# a JSON string (also one cut off at the end: a match never fails once started, so the scan stays linear), or a
# bracket that opens a mapping or list
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.|\\\Z)*+(?:"|\Z)|[\[{]', re.S)


def _check_json_containers(body: bytes, limit: int) -> None:
    """413 when a JSON body opens more than `limit` mappings/lists, counted before json.loads builds any."""
    if body.count(b"[") + body.count(b"{") <= limit:   # brackets inside strings counted too: an upper bound
        return
    n = 0
    for m in _JSON_TOKEN.finditer(body):
        if m.end() - m.start() == 1 and body[m.start()] != 0x22:   # a bracket, not a string
            n += 1
            if n > limit:
                raise _too_many_containers(limit)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("", f"msgpack extension type {code} is not accepted")


def _np_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialize {type(obj).__name__}")


# A field's place in the tree is a link, (parent link, key or index), None at the root: one small tuple per container
# entered, the dotted path built only when a refusal names it.
def field_path(link: Any) -> str:
    """(((None, "input"), "image"), 3) -> "input.image[3]"."""
    parts = []
    while link is not None:
        link, key = link
        parts.append(key)
    out = ""
    for p in reversed(parts):
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def _key_text(k: Any, link: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, (bytes, bytearray)):
        try:
            return bytes(k).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(field_path(link), "a mapping key is not valid UTF-8") from None
    raise ProtocolError(field_path(link), f"mapping keys must be strings, got {type(k).__name__}")


def _leaf_problem(v: Any) -> str | None:
    """Why a scalar is refused (None: it is fine)."""
    t = type(v)
    if t is str:
        if not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return "string is not valid Unicode (lone surrogate)"
    elif t is int:
        if not INT_MIN <= v <= INT_MAX:
            return "integer out of range (-2**63..2**64-1)"
    elif t is float:
        if not math.isfinite(v):
            return f"numbers must be finite, got {v}"
    elif t is bytes or t is bool or v is None:
        pass
    elif isinstance(v, (msgpack.Timestamp, msgpack.ExtType)):
        code = -1 if isinstance(v, msgpack.Timestamp) else v.code
        return f"msgpack extension type {code} is not accepted"
    else:
        return f"unsupported value of type {t.__name__}"
    return None


def _check_leaf(v: Any, link: Any) -> None:
    problem = _leaf_problem(v)
    if problem is not None:
        raise ProtocolError(field_path(link), problem)


def _marker_get(d: dict, key: str) -> Any:
    return d[key] if key in d else d.get(key.encode())


def _is_npgeneric(v: dict) -> bool:
    return bool(_marker_get(v, "__npgeneric__"))


def _npgeneric_value(v: dict, link: Any) -> Any:
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
        raise ProtocolError(field_path(link), f"a numpy scalar must carry a bool, int or float of its dtype, got "
                                              f"dtype {str(dtype)[:20]!r} and {type(data).__name__}")
    value = float(data) if kind == "f" else data
    _check_leaf(value, link)
    return value


def _str_keys(node: dict, link: Any) -> None:
    """bytes keys -> str, in place (400 for keys that are neither, or "k" and b"k" together)."""
    if all(type(k) is str for k in node):
        return
    items = [(_key_text(k, link), v) for k, v in node.items()]
    if len({k for k, _ in items}) != len(items):
        raise ProtocolError(field_path(link), "duplicate mapping keys (str and bytes spellings)")
    node.clear()
    node.update(items)


def check_tree(obj: Any, max_depth: int = DecodeLimits.max_depth) -> None:
    """One iterative pass over a decoded body (see the module doc), depth first: the stack holds one iterator per
    container on the current path (at most max_depth), never the pending siblings. Rewrites bytes keys as str and
    numpy-scalar markers as Python scalars, in place."""
    stack: list[tuple[Any, Any, Any]] = []     # (container, its (key, value) iterator, its link)

    def enter(node: Any, link: Any) -> None:
        if len(stack) >= max_depth:
            raise ProtocolError(field_path(link), f"nested deeper than {max_depth} levels")
        if type(node) is dict:
            _str_keys(node, link)
            stack.append((node, iter(node.items()), link))
        else:
            stack.append((node, enumerate(node), link))

    if type(obj) is not dict and type(obj) is not list:
        _check_leaf(obj, None)
        return
    enter(obj, None)
    while stack:
        node, items, link = stack[-1]
        inner_ok = len(stack) < max_depth       # a child list may be one level deeper
        for k, v in items:
            t = type(v)
            if t is list:
                if inner_ok:   # fast path for flat number lists (a pixel [r, g, b], a state vector): nothing to walk
                    for x in v:
                        tx = type(x)
                        if not ((tx is int and INT_MIN <= x <= INT_MAX) or (tx is float and x - x == 0.0)):
                            break   # a container or a bad leaf: the walk below finds and names it
                    else:
                        continue
                enter(v, (link, k))
                break
            if t is int and INT_MIN <= v <= INT_MAX:
                continue
            if t is dict:
                if _is_npgeneric(v):
                    node[k] = _npgeneric_value(v, (link, k))   # a value replaced, no key added: iteration goes on
                    continue
                enter(v, (link, k))
                break
            problem = _leaf_problem(v)
            if problem is not None:
                raise ProtocolError(field_path((link, k)), problem)
        else:
            stack.pop()


def decode_body(body: bytes, content_type: str | None, max_depth: int = DecodeLimits.max_depth,
                max_containers: int = DecodeLimits.max_containers, lenient: bool = False) -> dict[str, Any]:
    """Request/response bytes -> dict: msgpack or JSON as the content type says (415 for any other, or none), at
    most max_containers mappings/lists (413), then check_tree. lenient (a client reading a server's answer, which
    a browser cannot forge: a proxy's or a bare framework's content type): any type other than msgpack's is read
    as JSON."""
    if not lenient:
        check_content_type(content_type)
    if is_msgpack(content_type):
        # one count for mappings and lists; every container is at least one byte: a body no longer than the limit
        # needs none
        count = _ContainerCount(max_containers)
        hooks = {"object_hook": count, "list_hook": count} if len(body) > max_containers else {}
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_refuse_ext, **hooks)
        except ProtocolError:
            raise
        except msgpack.StackError:
            raise ProtocolError("", f"body is nested deeper than {max_depth} levels") from None
        except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
            why = str(e)[:200] or "a byte that begins no msgpack value"   # FormatError says nothing (0xc1)
            raise ProtocolError("", f"body is not valid msgpack ({type(e).__name__}: {why})") from None
    else:
        data = body.encode() if isinstance(body, str) else bytes(body)
        if json.detect_encoding(data) not in ("utf-8", "utf-8-sig"):   # (json.loads would read UTF-16/32 too)
            raise ProtocolError("", "a JSON body must be UTF-8")
        _check_json_containers(data, max_containers)
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
