"""The server's budget of decoded image bytes over every request it holds, queued or computing (max_decoded_mb caps
one request; max_queue counts observations, not bytes: ten requests of five 4096 x 4096 PNGs of 58 KB each held 2.4 GB
while they queued).

A request takes a Ticket; its ImageBudget (wamkit.protocol.limits) takes each image's bytes from it before the array
is built, from any thread, and the ticket gives them back when the request is done, on every path (answered,
refused, failed, cancelled: a `with` block). Past the budget, DecodedBytesFull: 503 + Retry-After. A decode thread
that outlives its request (cancelled at shutdown) can take nothing more once the ticket is given back.
"""

from __future__ import annotations

import threading
from typing import Callable

from wamkit.core.lifecycle import ClosingContext
from wamkit.protocol.errors import ProtocolError


class DecodedBytesFull(ProtocolError):
    """503: the images would not fit the server's budget now. A ProtocolError so that the decoders, which turn any
    other error into a 400 naming the field, let it through untouched."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__("", message, status=503)
        self.retry_after_s = retry_after_s


class DecodedBytes:
    def __init__(self, capacity: int, retry_after_s: Callable[[], float] = lambda: 1.0):
        self.capacity = int(capacity)
        self.used = 0
        self.retry_after_s = retry_after_s      # the server's estimate of when room frees up (its batcher's)
        self._lock = threading.Lock()

    def ticket(self) -> Ticket:
        return Ticket(self)


class Ticket(ClosingContext):
    """One request's share of a DecodedBytes (module doc)."""

    def __init__(self, pool: DecodedBytes):
        self.pool = pool
        self.held = 0
        self.closed = False

    def take(self, nbytes: int) -> None:
        pool = self.pool
        with pool._lock:
            fits = not self.closed and pool.used + nbytes <= pool.capacity
            if fits:
                pool.used += nbytes
                self.held += nbytes
        if not fits:
            raise DecodedBytesFull(f"the images of the requests in this server would decode to more than "
                                   f"{pool.capacity} bytes (server max_inflight_decoded_mb); retry later",
                                   pool.retry_after_s())

    def close(self) -> None:
        """Give the bytes back (idempotent); the request's images take no more."""
        with self.pool._lock:
            self.pool.used -= self.held
            self.held = 0
            self.closed = True

