"""Process checks the lifecycle tests share: is a pid still running, which processes descend from one, and the
environment one was started with (read from /proc, Linux)."""

from __future__ import annotations

import time
from pathlib import Path


def start_environ(pid: int, timeout: float = 10.0) -> dict[bytes, bytes]:
    """The environment `pid` was started with. Read right after Popen returns, /proc/PID/environ can still be empty:
    the parent learns the exec succeeded (its close-on-exec pipe closes) before the kernel has laid out the new
    program's environment, a window a loaded machine widens (a CI run read None for a variable that was set)."""
    deadline = time.monotonic() + timeout
    while True:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        if raw or time.monotonic() > deadline:
            return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
        time.sleep(0.01)


def _state_and_parent(pid: int | str) -> tuple[str, int] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()   # after "(comm)": state, ppid
    except OSError:
        return None
    return fields[0], int(fields[1])


def running(pid: int) -> bool:
    """pid exists and is not a zombie (an exited process its parent, or its new parent, has not reaped yet)."""
    s = _state_and_parent(pid)
    return s is not None and s[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """The running processes below `pid`: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        s = _state_and_parent(stat.parent.name)
        if s is not None and s[0] not in ("Z", "X"):
            children.setdefault(s[1], []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _proc_net_address(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} ("0100007F", 32 hex digits for IPv6: 32-bit words in host order) as text."""
    import ipaddress
    import socket
    import struct

    raw = bytes.fromhex(hex_addr)
    words = b"".join(struct.pack("=I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)))


def listeners(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket (IPv4 and IPv6) the processes `pids` hold."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = str(fd.readlink())
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:       # 0A = LISTEN
                addr, port = f[1].split(":")
                out.append((inodes[f[9]], _proc_net_address(addr), int(port, 16)))
    return out


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 and ::ffff:127.x (an IPv6 socket bound to an IPv4 loopback address)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)
