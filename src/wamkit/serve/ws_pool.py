"""The websocket client's connections: up to `max_connections`, opened on demand and kept; each carries one request
at a time (the protocols answer in order). A new connection's first frame is the server's metadata, kept from the
first connection."""

from __future__ import annotations

import asyncio
from typing import Any

from wamkit.protocol.openpi import unpackb
from wamkit.serve.ws_codec import Refused

# a whole observation frame (~400 kB for 2 cameras 256x256) is handed to the socket at once instead of draining in
# 32 kB steps (a few event-loop round trips per frame)
WRITE_LIMIT = 4 * 1024 * 1024
# the largest frame read from a server: a chunk of actions is kilobytes, so only a broken or hostile server (a
# server.url the user gave) sends more; websockets then closes the connection (1009) and the request is retried,
# then the run stops naming the server, instead of this process buffering whatever it is sent
MAX_FRAME_BYTES = 64 * 1024 * 1024


class ConnectionPool:
    def __init__(self, url: str, headers: dict[str, str], max_connections: int, connect_timeout_s: float,
                 timeout_s: float):
        self.url, self.headers = url, headers
        self.max_connections = int(max_connections)
        self.connect_timeout_s, self.timeout_s = float(connect_timeout_s), float(timeout_s)
        self.metadata: dict[str, Any] | None = None
        self.idle: list = []
        self.open: set = set()
        self._slots: asyncio.Semaphore | None = None

    async def connect(self):
        """A new connection, its metadata frame read (websockets' errors, or Refused for a text frame)."""
        from websockets.asyncio.client import connect

        ws = await connect(self.url, additional_headers=self.headers or None, compression=None,
                           max_size=MAX_FRAME_BYTES, open_timeout=self.connect_timeout_s, write_limit=WRITE_LIMIT)
        try:
            first = await asyncio.wait_for(ws.recv(), self.timeout_s)
            if isinstance(first, str):
                raise Refused(f"server sent text instead of the metadata frame: {first[:500]}", 500)
            md = unpackb(first)
        except BaseException:
            await ws.close()
            raise
        if self.metadata is None:
            self.metadata = md
        self.open.add(ws)
        return ws

    async def acquire(self):
        """An idle open connection, or a new one; waits while max_connections are in use."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_connections)
        await self._slots.acquire()
        try:
            while self.idle:
                ws = self.idle.pop()
                if ws.state.name == "OPEN":
                    return ws
                self.open.discard(ws)
            return await self.connect()
        except BaseException:
            self._slots.release()
            raise

    async def release(self, ws, reusable: bool) -> None:
        """Give a connection back: kept for the next request when reusable and open, else closed."""
        if self._slots is not None:
            self._slots.release()
        if reusable and ws in self.open and ws.state.name == "OPEN":
            self.idle.append(ws)
        else:
            self.open.discard(ws)
            await close_quietly(ws)

    async def close(self) -> None:
        """Close every connection (with no request in flight); the pool may be used again, from another loop too."""
        conns, self.idle, self.open = list(self.open), [], set()
        self._slots = None
        await asyncio.gather(*(close_quietly(ws) for ws in conns))


async def close_quietly(ws) -> None:
    try:
        await asyncio.wait_for(ws.close(), 5.0)
    except Exception:  # already gone: nothing to tidy
        pass
