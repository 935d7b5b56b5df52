"""Arrays by reference through shared memory, for a client and an action server on one host (wamkit's extension of
the websocket frames; opt-in on both sides).

A frame's images and states are megabytes (16 MetaWorld observations: 2.4 MB) that a loopback websocket moves
through msgpack, the socket and back into arrays: a 2.4 MB frame's round trip costs ~14 ms on a 2-core CPU against
~0.6 ms to copy the same bytes into shared memory. Here the client copies each array into a shared-memory file of
its own (a *slot*, under /dev/shm) and sends, in place of openpi's array marker, a reference:

    {"__shm__": "<file name>", "offset": <int>, "dtype": "<u1", "shape": [224, 224, 3]}

The server copies the referenced bytes out of the file (pread) and hands the field decoders an ordinary array marker
with them, so every check of the inline form applies unchanged (dtype, shape, byte length, image size caps). It
copies rather than maps: a read through a mapping past the end of a file that its client shrank kills the reader
with SIGBUS, a cached mapping keeps serving a file the client has since unlinked and re-created under the same name,
and mappings of unlinked files keep their memory until unmapped. A copy costs ~0.1 ms per MB.

- Client (`ShmSlots`): one slot per request in flight, taken before encoding and given back when the reply has
  arrived; a slot whose request failed is dropped (the server may still be reading it), never reused. Slots grow by
  new files; every file is unlinked when the client closes (and at interpreter exit). A slot's name carries its
  client's pid, so a client that starts removes the slots of clients that were killed before they could.
- Server (`ShmReader`): only when started with `shm_arrays=true`, and only for loopback connections. A name must be
  a slot name (`wamkit-shm-` + 16-64 letters, digits or _), resolved in /dev/shm, opened without following links; the
  file must be a regular file owned by the server's user and at most `max_file_bytes`; the reference must lie inside
  it, and its bytes must still be there when read. Anything else answers 400 naming the field. Each frame opens the
  files it names once and closes them before it is answered: the server holds no file between frames.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import stat
from typing import Any

import msgpack
import numpy as np

from wamkit.core.shm_names import SHM_DIR, owned_name, sweep_orphans
from wamkit.protocol.errors import ProtocolError
from wamkit.protocol.limits import parse_dtype

PREFIX = "wamkit-shm-"
MARKER = "__shm__"
UNREADABLE = "cannot read shared-memory slot"   # the server's refusal when a slot is not there for it (the client
                                                # then sends inline arrays: another mount namespace, another user)
_NAME = re.compile(r"^wamkit-shm-[A-Za-z0-9_]{16,64}$")
_ARRAY_MARKER = b"__ndarray__"


def available() -> bool:
    """Whether this host has a shared-memory directory to put slots in."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


# ------------------------------------------------------------------------------------------------ client
class _Slot:
    def __init__(self, size: int):
        self.name = owned_name(PREFIX)
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size

    def pack(self, obj: Any) -> bytes:
        """msgpack of `obj` with every numeric array copied into this slot and sent as a reference."""
        offset = 0

        def default(o: Any) -> Any:
            nonlocal offset
            if isinstance(o, np.ndarray):
                if o.dtype.kind not in "biuf":
                    raise TypeError(f"arrays of dtype {o.dtype} are not sent")
                a = np.ascontiguousarray(o)
                offset = -(-offset // 64) * 64          # 64-byte aligned
                if offset + a.nbytes > self.size:
                    raise _TooSmall
                np.frombuffer(self.mm, np.uint8, a.nbytes, offset)[:] = a.reshape(-1).view(np.uint8)
                ref = {MARKER: self.name, "offset": offset, "dtype": a.dtype.str, "shape": list(a.shape)}
                offset += a.nbytes
                return ref
            if isinstance(o, np.generic):
                return o.item()
            raise TypeError(f"cannot serialize {type(o).__name__}")

        return msgpack.packb(obj, use_bin_type=True, default=default)

    def drop(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass


class _TooSmall(Exception):
    pass


def _array_bytes(obj: Any) -> int:
    """Bytes of the arrays in obj (with alignment slack)."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes + 64
    if isinstance(obj, dict):
        return sum(_array_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_array_bytes(v) for v in obj)
    return 0


class ShmSlots:
    """The client's slots (module doc): `pack(body)` -> (frame, slot); `done(slot, ok)` after the reply."""

    def __init__(self):
        self.free: list[_Slot] = []
        self.all: set[_Slot] = set()
        sweep_orphans(PREFIX, SHM_DIR)
        atexit.register(self.close)

    def pack(self, body: Any) -> tuple[bytes, _Slot]:
        need = max(1 << 16, _array_bytes(body))
        slot = None
        while self.free:
            s = self.free.pop()
            if s.size >= need:
                slot = s
                break
            self._forget(s)                   # too small for what requests carry now
        if slot is None:
            slot = _Slot(int(need * 1.25))
            self.all.add(slot)
        try:
            return slot.pack(body), slot
        except BaseException:
            self._forget(slot)
            raise

    def done(self, slot: _Slot, ok: bool) -> None:
        """The reply to the request in `slot` arrived (ok) and the slot may be reused; else it is dropped."""
        if ok and slot in self.all:
            self.free.append(slot)
        else:
            self._forget(slot)

    def _forget(self, slot: _Slot) -> None:
        self.all.discard(slot)
        slot.drop()

    def close(self) -> None:
        for s in list(self.all):
            self._forget(s)
        self.free = []


# ------------------------------------------------------------------------------------------------ server
class _FrameFiles(dict):
    """One frame's open slots (name -> (fd, size)) and the bytes its references have copied so far."""
    copied = 0


class ShmReader:
    """The server's reads of client slots (module doc)."""

    def __init__(self, max_file_bytes: int, max_frame_bytes: int | None = None):
        self.max_file_bytes = int(max_file_bytes)
        # all the arrays one frame's references copy out (the server's max_decoded_mb): many references to one
        # large slot in a small frame (a probe: 60 refs to a 32 MiB slot, 2.1 GB copied before the decode budget
        # refused it) are refused before anything is copied
        self.max_frame_bytes = int(max_frame_bytes) if max_frame_bytes else None

    def resolve(self, obj: Any, path: str = "") -> Any:
        """A decoded frame with slot references -> the same frame with array markers holding copies of their bytes."""
        files = _FrameFiles()                        # slot name -> (fd, size), for this frame only
        try:
            return self._resolve(obj, path, files)
        finally:
            for fd, _ in files.values():
                os.close(fd)

    def _resolve(self, obj: Any, path: str, files: dict) -> Any:
        if isinstance(obj, dict):
            if MARKER in obj:
                return self._marker(obj, path, files)
            return {k: self._resolve(v, f"{path}.{k}" if path else str(k), files) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._resolve(v, f"{path}[{i}]", files) for i, v in enumerate(obj)]
        return obj

    def _open(self, name: Any, path: str, files: dict) -> tuple[int, int]:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ProtocolError(path, f"not a shared-memory slot name: {str(name)[:80]!r}")
        if name in files:
            return files[name]
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise ProtocolError(path, f"{UNREADABLE} {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ProtocolError(path, f"{UNREADABLE} {name}: not a regular file of the server's user")
            if not 0 < st.st_size <= self.max_file_bytes:
                raise ProtocolError(path, f"shared-memory slot {name} has {st.st_size} bytes (at most "
                                          f"{self.max_file_bytes})", 413)
        except BaseException:
            os.close(fd)
            raise
        files[name] = (fd, st.st_size)
        return files[name]

    def _marker(self, ref: dict, path: str, files: dict) -> dict:
        name = ref.get(MARKER)
        fd, size = self._open(name, path, files)
        off, dtype, shape = ref.get("offset"), ref.get("dtype"), ref.get("shape")
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise ProtocolError(path + ".offset", "must be a non-negative integer")
        if not isinstance(dtype, str):
            raise ProtocolError(path + ".dtype", f"expected a dtype string such as '<f4', got {type(dtype).__name__}")
        try:
            dt = parse_dtype(dtype)
        except ValueError:
            raise ProtocolError(path + ".dtype", f"unknown dtype {dtype[:40]!r}") from None
        if dt.kind not in "biuf":
            raise ProtocolError(path + ".dtype", f"arrays of dtype {dt} are not accepted")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                   for d in shape) or len(shape) > 8):
            raise ProtocolError(path + ".shape", "must be a list of at most 8 non-negative integers")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if nbytes < 0 or off + nbytes > size:
            raise ProtocolError(path, f"bytes {off}..{off + nbytes} lie outside the slot ({size} bytes)")
        files.copied += nbytes
        if self.max_frame_bytes is not None and files.copied > self.max_frame_bytes:
            raise ProtocolError(path, f"the frame's shared-memory arrays come to more than {self.max_frame_bytes} "
                                      f"bytes (server max_decoded_mb)", 413)
        data = bytearray(nbytes)
        got = 0
        while got < nbytes:                       # the client may shrink its file under us: a short read, no signal
            n = os.preadv(fd, [memoryview(data)[got:]], off + got)
            if n <= 0:
                raise ProtocolError(path, f"shared-memory slot {name} ended at byte {off + got} while being read "
                                          f"(the client changed it)")
            got += n
        return {_ARRAY_MARKER: True, b"data": data, b"dtype": dt.str, b"shape": shape}


def refuse(obj: Any, path: str = "") -> None:
    """ProtocolError at the first slot reference in obj: for a server (or a connection) that does not take them."""
    if isinstance(obj, dict):
        if MARKER in obj:
            raise ProtocolError(path, "shared-memory array references need a server started with shm_arrays=true "
                                      "and a client on the same host (loopback)")
        for k, v in obj.items():
            refuse(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            refuse(v, f"{path}[{i}]")
