"""The HTTP layer under the action server: the listening socket and uvicorn's h11 protocol with guards against slow and
idle clients (uvicorn alone closes idle keep-alive connections only).

- bind_socket(): binds before the policy is built, so a port in use is one clear line (UserError, exit 2), not a
  failure after minutes of model loading.
- guarded_protocol(): an H11Protocol subclass with
  * a header deadline: from the moment a connection opens (or its previous response completes), the next request's
    headers must arrive within header_timeout_s, else the socket is closed (slowloris, idle sockets, a body that
    never comes for a route that does not read it); a connection upgraded to a websocket is past its headers, and
    the deadline ends with the upgrade;
  * a connection cap: past max_connections open sockets (websockets included), the oldest one still waiting for
    headers is dropped, else the one whose body arrives slowest when that is below min_body_kb_per_s on average since
    its headers (answered 408), else the new one (every open socket is busy with a request), so a flood of idle
    sockets or of bodies sent a byte at a time can neither exhaust file descriptors nor lock out /health; websockets
    never take the cap's last _WS_RESERVE connections (an upgrade past that is answered 503).
  The body deadline (body_timeout_s, 408) lives in the app, which reads the body.
- host_guard(): bound to loopback, a request (or websocket handshake) whose Host header is not a loopback name is
  refused with 400 (DNS rebinding: a page of any site whose name resolves to 127.0.0.1 would otherwise reach a
  server without a token from the browser; allowed_hosts adds names). An ASGI wrapper of the app, on the listener
  only.
- redact_logs(): Authorization / Api-Key header values never reach a log (uvicorn and websockets log handshake headers
  at debug and trace levels).
- connection_limits(): the connection cap and listen backlog that fit the open-file limit.
- tune_malloc(): large request buffers from malloc's heap, not a fresh mmap (and page faults) per copy.
- uvicorn_config(): the uvicorn.Config of a ServeConfig (keep-alive timeout, header size cap, backlog, the protocol
  and the guards above; websockets without permessage-deflate).
"""

from __future__ import annotations

import errno
import logging
import re
import resource
import socket
from typing import Any

from wamkit.core.errors import UserError
from wamkit.serve.config import ServeConfig, is_loopback
from wamkit.serve.errors import error_response

log = logging.getLogger("wamkit.serve")
_FD_RESERVE = 64   # file descriptors kept for everything that is not a client socket (logs, libraries, the policy)
_BACKLOG = 2048    # uvicorn's default listen backlog
_WS_RESERVE = 16   # connections of the cap never taken by websockets (plain HTTP, /health), at most a quarter of it


MALLOC_MMAP_THRESHOLD = 32 * 1024 * 1024    # glibc's largest: request bodies and their copies come from the heap
MALLOC_TRIM_THRESHOLD = 128 * 1024 * 1024   # free heap kept before it is returned to the system


def tune_malloc() -> bool:
    """Keep the server's large, short-lived buffers (a request body, h11's and uvicorn's copies of it, the decoded
    arrays: 2.4 MB each for 16 observations of 224x224x3) in malloc's heap instead of fresh mmaps: glibc maps and unmaps
    every allocation over its (adaptive) mmap threshold and trims the heap top once 2x that is free, so each copy of
    every request faulted its pages in anew (bench/results/request_overhead.md: ~3 ms a request of 2.4 MB on the 2-core
    CPU). Process-wide, glibc only (a no-op elsewhere); up to MALLOC_TRIM_THRESHOLD of freed heap stays mapped. True
    when applied."""
    import ctypes
    import ctypes.util
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim, m_mmap = -1, -3   # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
        return bool(libc.mallopt(m_mmap, MALLOC_MMAP_THRESHOLD)) and bool(libc.mallopt(m_trim, MALLOC_TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening); UserError when the port is taken or the host unknown."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"host={host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only: a listening port stays refused
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port={port}: already in use on {host}; choose another port (port=0 picks a free "
                            f"one)") from None
        raise UserError(f"cannot bind {host}:{port}: {e.strerror}") from None
    return sock


def connection_limits(wanted: int) -> tuple[int, int]:
    """(max connections, listen backlog) that fit the process's open-file limit, raising the soft limit when allowed.
    asyncio accepts up to `backlog` sockets per wake-up before any of them is seen (and maybe dropped) by the protocol,
    so open connections + backlog + a reserve must fit in the limit, or accept() fails with EMFILE and the server stops
    accepting for a second (/health included)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + _BACKLOG + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted, _BACKLOG
    spare = max(2, soft - _FD_RESERVE)
    backlog = max(1, min(_BACKLOG, spare // 4))
    cap = max(1, min(wanted, spare - backlog))
    log.warning("max_connections=%d clamped to %d (listen backlog %d) by the open-file limit (%d)", wanted, cap,
                backlog, soft)
    return cap, backlog


def _answer_and_close(transport, status: int, reason: str, message: str) -> None:
    """A JSON error response written straight to the socket, which is then closed (a guard's last word)."""
    body = error_response(status, message).body
    transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body))
    transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int, counters: Any = None,
                     min_body_kb_per_s: float = 0.0) -> type:
    """uvicorn's H11Protocol with the header deadline and the connection cap (module doc). counters: an object with
    count(name) (the server's metrics), told of every socket closed by a guard."""
    min_rate = min_body_kb_per_s * 1024.0   # bytes per second
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def count(name: str) -> None:
        if counters is not None:
            counters.count(name)

    upgraded: set = set()    # the transports of the connections upgraded to websockets (they leave h11's set)
    ws_cap = max(1, max_connections - min(_WS_RESERVE, max_connections // 4))

    def open_websockets() -> int:
        upgraded.difference_update([t for t in upgraded if t.is_closing()])
        return len(upgraded)

    class GuardedH11Protocol(H11Protocol):
        _hdr_timer = None
        _hdr_cycle = None
        _armed_at = 0.0
        _body_since = 0.0   # when the current request's headers were in
        _body_bytes = 0     # bytes received since

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()
            if len(self.connections) > max_connections:     # (uvicorn's websocket protocols are in it too)
                self._drop_one()

        def _arm(self) -> None:
            self._disarm()
            self._hdr_cycle = self.cycle            # headers are complete once uvicorn starts a new cycle
            self._armed_at = self.loop.time()
            self._hdr_timer = self.loop.call_later(header_timeout_s, self._header_deadline)

        def _disarm(self) -> None:
            if self._hdr_timer is not None:
                self._hdr_timer.cancel()
                self._hdr_timer = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._hdr_timer is not None and self.cycle is not self._hdr_cycle:
                self._disarm()
                self._body_since, self._body_bytes = self.loop.time(), 0
            self._body_bytes += len(data)

        def _body_rate(self, now: float) -> float | None:
            """Bytes per second since the headers while the request's body is still arriving (and the server is
            reading it); None otherwise."""
            cycle = self.cycle
            if (self._hdr_timer is not None or cycle is None or not cycle.more_body or cycle.response_complete or
                    self.flow.read_paused or self.transport.is_closing()):
                return None
            return self._body_bytes / max(now - self._body_since, 1e-9)

        def handle_websocket_upgrade(self, event) -> None:
            # the headers are complete and the socket is the websocket's from now on: the deadline (and this
            # protocol's hold on the transport) ends here; left armed, it closed every websocket header_timeout_s
            # after it opened (session 21: requests in flight stalled 0.2-0.5 s every 10 s while the client
            # reconnected and retried). Websockets still count against the cap, and never take its last
            # _WS_RESERVE connections: past that, the upgrade is answered 503
            self._disarm()
            if open_websockets() >= ws_cap:
                count("closed_websocket_cap")
                _answer_and_close(self.transport, 503, "Service Unavailable",
                                  f"too many open websockets (max_connections={max_connections})")
                return
            upgraded.add(self.transport)
            super().handle_websocket_upgrade(event)

        def on_response_complete(self) -> None:
            prev = self.cycle
            super().on_response_complete()           # may start a pipelined request's cycle
            if not self.transport.is_closing() and self.cycle is prev:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _header_deadline(self) -> None:
            self._hdr_timer = None
            if not self.transport.is_closing():
                count("closed_header_timeout")
                self.transport.close()

        def _drop_one(self) -> None:
            others = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c is not self and
                      not c.transport.is_closing()]
            waiting = [c for c in others if c._hdr_timer is not None]
            count("closed_connection_cap")
            if waiting:
                victim = min(waiting, key=lambda c: c._armed_at)
                victim._disarm()
                victim.transport.close()
                return
            now = self.loop.time()
            rates = [(rate, c) for c in others if (rate := c._body_rate(now)) is not None and rate < min_rate]
            if not rates:
                self._disarm()
                self.transport.close()
                return
            rate, victim = min(rates, key=lambda rc: rc[0])
            if victim.cycle.response_started:
                victim.transport.close()
            else:
                _answer_and_close(victim.transport, 408, "Request Timeout",
                                  f"body arriving at {rate / 1024:.2g} KB/s, below min_body_kb_per_s="
                                  f"{min_body_kb_per_s:g}, while the server is at max_connections={max_connections}")

    return GuardedH11Protocol


def draining_websocket_protocol() -> type:
    """uvicorn's websocket protocol (the sans-I/O one its "auto" picks), except that a shutdown (SIGTERM) answers
    the frame the application is computing before it closes the connection: uvicorn closes every websocket at once
    with 1012, so a frame in flight got no reply while its batch was still computed (HTTP requests in flight are
    answered). The connection stops reading at the shutdown, so no new frame starts; frames already read but not yet
    taken by the application are not in flight and go unanswered (the client retries them elsewhere or later).
    uvicorn's graceful timeout (`graceful_timeout_s`) still bounds the wait."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    class DrainingWebSocketProtocol(WebSocketsSansIOProtocol):
        _in_flight = 0              # frames the application has taken and not answered yet
        _close_when_answered = False

        async def receive(self):
            message = await super().receive()
            if message["type"] == "websocket.receive":
                self._in_flight += 1
            return message

        async def send(self, message) -> None:
            await super().send(message)
            if message["type"] == "websocket.send" and self._in_flight:
                self._in_flight -= 1
                if self._close_when_answered and not self._in_flight:
                    self._close_when_answered = False
                    super().shutdown()

        def shutdown(self) -> None:
            if self._in_flight and self.handshake_complete and not self.close_sent and not self.transport.is_closing():
                self._close_when_answered = True
                self.transport.pause_reading()
                self.read_paused = False     # (so that receive() does not resume it)
                return
            super().shutdown()

    return DrainingWebSocketProtocol


def host_name(host: str) -> str:
    """The name of a Host header, without its port: 'LocalHost:8000' -> 'localhost', '[::1]:8000' -> '::1'."""
    h = host.strip().lower()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def host_guard(app: Any, cfg: ServeConfig, counters: Any = None) -> Any:
    """`app` behind the Host check (module doc): the app itself when the server is not bound to loopback or
    allowed_hosts holds "*"."""
    allowed = {h.strip().lower() for h in cfg.allowed_hosts}
    if not is_loopback(cfg.host) or "*" in allowed:
        return app

    async def guarded(scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            raw = dict(scope.get("headers") or ()).get(b"host")   # none: HTTP/1.0, not a browser
            host = raw.decode("latin-1") if raw is not None else None
            if host is not None and not (is_loopback(host_name(host)) or host_name(host) in allowed):
                await _refuse_host(scope, receive, send, host, counters)
                return
        await app(scope, receive, send)

    return guarded


async def _refuse_host(scope, receive, send, host: str, counters: Any) -> None:
    from starlette.websockets import WebSocket

    resp = error_response(400, f"Host header {host[:100]!r} is not a loopback name, and this server is bound to "
                               f"loopback (server allowed_hosts adds names)")
    if counters is not None:
        counters.count("requests")
        counters.response(400)
    if scope["type"] == "http":
        await resp(scope, receive, send)
        return
    ws = WebSocket(scope, receive, send)
    if "websocket.http.response" in scope.get("extensions", {}):
        await ws.send_denial_response(resp)
    else:   # an ASGI server without denial responses: refuse the handshake (HTTP 403)
        await ws.close(code=1008)


# a credential header's value as uvicorn and websockets log it: 'authorization: Bearer x' (websockets, debug) or
# "(b'authorization', b'Bearer x')" (uvicorn's ASGI scope, trace)
_SECRET_HEADER = re.compile(r"(?i)\b((?:x-)?api-key|authorization)(['\"]?\s*(?::|=|,)\s*b?['\"]?)([^'\"\r\n]+)")


class RedactSecrets(logging.Filter):
    """Replaces credential header values in a log record by [redacted] (it always lets the record through)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is left to logging's own handling
            return True
        red = _SECRET_HEADER.sub(r"\1\2[redacted]", text)
        if red != text:
            record.msg, record.args = red, None
        return True


def redact_logs() -> None:
    """RedactSecrets on the loggers that log request headers and on every handler the server's logging has (uvicorn
    configures its own when its Config is built: call this after)."""
    f = RedactSecrets()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "uvicorn.asgi", "uvicorn.access",
                                              "websockets", "websockets.server", "wamkit")]
    for lg in loggers:
        for target in [lg, *lg.handlers]:
            if not any(isinstance(x, RedactSecrets) for x in target.filters):
                target.addFilter(f)


def uvicorn_config(app: Any, cfg: ServeConfig, counters: Any = None):
    import uvicorn

    cap, backlog = connection_limits(cfg.max_connections)
    proto = guarded_protocol(cfg.header_timeout_s, cap, counters, cfg.min_body_kb_per_s)
    config = uvicorn.Config(host_guard(app, cfg, counters), host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            access_log=False, timeout_graceful_shutdown=cfg.graceful_timeout_s, lifespan="on",
                            http=proto, backlog=backlog, timeout_keep_alive=cfg.keep_alive_timeout_s,
                            h11_max_incomplete_event_size=cfg.max_header_kb * 1024, ws=draining_websocket_protocol(),
                            ws_max_size=int(cfg.max_body_mb * 1024 * 1024) + 1024,  # websocket frames: the body cap
                            # no permessage-deflate: frames of images do not compress, and a few KB of deflate
                            # inflated to a max_body_mb frame (openpi's and wamkit's clients turn it off anyway)
                            ws_per_message_deflate=False)
    redact_logs()   # after uvicorn's logging config (built with the Config)
    return config
