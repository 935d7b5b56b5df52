"""Async websocket action client: openpi's policy protocol or SGLang's realtime route, same interface as ActionClient.

    async with WebsocketActionClient("ws://gpu-box:8000", protocol="openpi") as c:
        actions = await c.predict(observations, seeds)          # float32 (N, H, D), in observation order

- protocol="openpi": one observation per frame (openpi's observation dict: ``observation/<camera>``,
  ``observation/state``, ``prompt``, plus ``seed``), reply ``{"actions": (H, D)}``. Works with openpi's own policy
  server (pi0 / pi0.5), SGLang's ``/openpi/policy`` and ``wamkit serve``. The url's default path: /openpi/policy.
- protocol="sglang-ws": SGLang's ``/v1/actions/realtime`` (default path): action requests, envelope replies; several
  observations per frame when the server's metadata frame says ``capabilities.batch_inputs``, else one. To a wamkit
  server (its metadata's `server.name`) in wamkit's forms (any cameras and states, one seed per observation); to any
  other server only in forms SGLang accepts, planned as ActionClient plans them for such a server
  (wamkit.protocol.sglang.plan_sglang_requests: one seed a frame, so observations are grouped by seed, prompt and
  shapes; several a frame only with one camera and no state), frames in flight at once.
- A pool of up to `max_connections` connections, opened on demand and kept: each carries one request at a time (the
  protocol answers in order), so one predict() of N observations puts up to N frames in flight at once, and several
  predict() calls overlap (the server batches frames from all connections together).
- max_request_size(): the server's per-frame batch where frames carry several observations, else max_connections
  (the observations one predict() can have in flight at once).
- Retries: connection failures (the connection is dropped, a ServerWorker given as `worker` is restarted when it
  stopped answering) and 429/5xx error replies (honouring ``retry_after_s``) with exponential backoff + jitter;
  other errors raise ActionClientError naming the server's message at once. A traceback in an error reply (SGLang's
  ``{"error": traceback}``, openpi's text frame) is read as its last line; ValueError / TypeError / KeyError there
  (SGLang's validation) is a client error, not retried (ws_codec.text_refusal).
- action_horizon: chunks longer than this are cut to their first action_horizon actions (what openpi's LIBERO
  example does with replan_steps=5; `wamkit eval horizon=5` passes it).
- Timing: each frame's record (``t_send``, ``t_recv``, ``client_ms``, ``attempts``, byte counts, ``server``: the
  reply's ``server_timing`` merged with wamkit's ``timing``) goes to `last_timings` and to `on_timing`.

Parts: `ws_codec` (each protocol's frames, routes, auth, error replies), `ws_pool` (the connections); this module
holds the client: retries, batching observations into frames, timing.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from wamkit.core.types import Observation
from wamkit.protocol import ProtocolError
from wamkit.protocol.client import (RETRY_STATUS, ActionClientError, RetryingClient, checked_seeds, client_error,
                                    exception_text, scatter_chunks)
from wamkit.protocol.openpi import packb, unpackb
from wamkit.protocol.sglang import is_wamkit_server, plan_sglang_requests
from wamkit.protocol.shm import UNREADABLE as SHM_UNREADABLE
from wamkit.protocol.shm import available as shm_available
from wamkit.serve.ws_codec import CODECS, DEFAULT_PATHS, PROTOCOLS, Refused, error_reply  # noqa: F401
from wamkit.serve.ws_pool import ConnectionPool


def websocket_url(url: str, protocol: str) -> str:
    """http(s):// or bare host:port -> ws(s)://; an empty path gets the protocol's route."""
    if "://" not in url:
        url = "ws://" + url
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"not a websocket url: {url!r}")
    path = parts.path if parts.path not in ("", "/") else DEFAULT_PATHS[protocol]
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class WebsocketActionClient(RetryingClient):
    def __init__(self, url: str, protocol: str = "openpi", token: str | None = None, max_request_size: int | None = None,
                 max_connections: int = 32, timeout_s: float = 120.0, connect_timeout_s: float = 10.0,
                 retries: int = 4, backoff: float = 0.25, backoff_max: float = 10.0,
                 parameters: dict[str, Any] | None = None, send_seed: bool = True,
                 postprocess: Callable[[np.ndarray], np.ndarray] | None = None,
                 on_timing: Callable[[dict[str, Any]], None] | None = None, raw_action_dim: int | None = None,
                 action_horizon: int | None = None, worker: Any = None, shm_arrays: bool = False,
                 retry_s: float = 0.0):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.protocol, self.codec = protocol, CODECS[protocol]
        self.url = websocket_url(url, protocol)
        self.token = token
        self._max_request = max_request_size
        self.max_connections = int(max_connections)
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self._headers = {"Authorization": f"{self.codec.auth_scheme} {token}"} if token else {}
        self.pool = self._new_pool()
        self._old_pools: list[ConnectionPool] = []
        self.retries, self.backoff, self.backoff_max = int(retries), float(backoff), float(backoff_max)
        self.retry_s = float(retry_s)
        self.parameters = dict(parameters or {})
        self.send_seed = bool(send_seed)          # openpi frames carry "seed" (wamkit and SGLang servers read it)
        self.postprocess, self.on_timing, self.raw_action_dim = postprocess, on_timing, raw_action_dim
        self.action_horizon = action_horizon      # keep the first H actions of longer chunks (openpi's replan_steps)
        self.worker = worker
        # arrays by reference through shared memory (protocol/shm.py): asked for, a server on this host that offers
        # them (its metadata: capabilities.shm_arrays)
        self.shm_arrays = bool(shm_arrays) and urlsplit(self.url).hostname in ("127.0.0.1", "localhost", "::1")
        self._slots = None
        self.shm_used = False                     # whether this client sent its arrays through shared memory
        self.last_timings: list[dict[str, Any]] = []
        self._per_frame: int | None = None        # observations per frame
        self._native = True                       # the server is wamkit (its metadata frame says so)
        self._restart_lock: asyncio.Lock | None = None

    # ------------------------------------------------------------------ connections
    def _new_pool(self) -> ConnectionPool:
        return ConnectionPool(self.url, self._headers, self.max_connections, self.connect_timeout_s, self.timeout_s)

    def _target(self, url: str) -> str:
        return websocket_url(url, self.protocol)

    async def _retarget(self, url: str) -> None:
        self.url = self._target(url)
        self._old_pools.append(self.pool)   # closed at aclose(): requests in flight on it finish or fail and retry
        self.pool = self._new_pool()

    async def aclose(self) -> None:
        """Close every connection (call it with no request in flight); the client may be used again afterwards,
        also from another event loop."""
        self._restart_lock = None
        for old in self._old_pools:
            await old.close()
        self._old_pools = []
        await self.pool.close()
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    async def __aenter__(self) -> "WebsocketActionClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _checkout(self):
        """(connection, None), or (None, why) after a failure worth retrying (the worker restarted if it stopped
        answering); a refused handshake that retrying cannot fix (401 bad token, 404 no such route) raises."""
        from websockets.exceptions import InvalidStatus, WebSocketException

        try:
            return await self.pool.acquire(), None
        except InvalidStatus as e:
            status = e.response.status_code
            why = f"handshake refused with HTTP {status}: {_denial_text(e.response)}"
            if status not in RETRY_STATUS:
                raise client_error(self.url, why, status) from None
            return None, why
        except (OSError, asyncio.TimeoutError, TimeoutError, WebSocketException, ProtocolError, Refused) as e:
            await self._maybe_restart_worker()
            return None, f"connect: {exception_text(e)}"

    async def _exchange(self, frame: bytes) -> tuple[dict[str, Any], int, int, float, float]:
        """Send one frame, return (decoded reply, attempts, reply bytes, t_send, t_recv); retries as documented."""
        from websockets.exceptions import WebSocketException

        last, attempt, t_first = "", 0, time.monotonic()
        while True:
            retry_after, status = None, None
            ws, why = await self._checkout()
            if ws is None:
                last = why
            else:
                reusable = False
                t_send = time.time()
                try:
                    await ws.send(frame)
                    raw = await asyncio.wait_for(ws.recv(), self.timeout_s)
                    reusable = True
                except (OSError, asyncio.TimeoutError, TimeoutError, WebSocketException) as e:
                    last = exception_text(e) if not isinstance(e, (asyncio.TimeoutError, TimeoutError)) else \
                        f"no reply within {self.timeout_s:g} s"
                    raw = None
                finally:
                    await self.pool.release(ws, reusable)
                t_recv = time.time()
                if raw is None:
                    await self._maybe_restart_worker()
                else:
                    reply: Any = raw
                    if not isinstance(raw, str):
                        try:
                            reply = unpackb(raw)
                        except ProtocolError as e:
                            raise ActionClientError(f"{self.url}: bad reply: {e}") from None
                    err = error_reply(reply)
                    if err is None:
                        return reply, attempt + 1, len(raw), t_send, t_recv
                    last, status = f"{err.status}: {err}", err.status
                    if err.status not in RETRY_STATUS:
                        raise client_error(self.url, last, err.status, raw)
                    retry_after = err.retry_after
            if not self._retry_again(attempt, t_first, status):
                raise self._gave_up("a request", attempt, t_first, last, status)
            await self._backoff(attempt, retry_after, last)
            attempt += 1

    # ------------------------------------------------------------------ API
    async def metadata(self) -> dict[str, Any]:
        """The server's metadata frame (the first connection's)."""
        last, attempt, t_first = "", 0, time.monotonic()
        while self.pool.metadata is None:
            ws, last = await self._checkout()
            if ws is not None:
                await self.pool.release(ws, True)
                if self.pool.metadata is not None:
                    break
                last = "connected, but no metadata frame came"
            if not self._retry_again(attempt, t_first, None):
                raise self._gave_up("the metadata frame", attempt, t_first, last)
            await self._backoff(attempt, None, last)
            attempt += 1
        return self.pool.metadata

    async def max_request_size(self) -> int:
        if self._per_frame is None:
            md = await self.metadata()
            caps = md.get("capabilities") or {}
            self._native = is_wamkit_server(md)
            self._per_frame = self.codec.per_frame(caps)
            if self.shm_arrays and caps.get("shm_arrays") and shm_available():
                from wamkit.protocol.shm import ShmSlots

                self._slots = ShmSlots()
                self.shm_used = True
        if not self._max_request:
            self._max_request = self._per_frame if self._per_frame > 1 else self.max_connections
        return int(self._max_request)

    def plan(self, observations: Sequence[Observation], per_frame: int, seeds: Sequence[int] | None = None
             ) -> list[list[int]]:
        """Indices of each frame: observations with the same cameras/shapes/state length, at most per_frame (to a
        server that is not wamkit, over sglang-ws: plan_sglang_requests, which needs the seeds)."""
        if self.protocol == "sglang-ws" and not self._native:
            return plan_sglang_requests(observations, seeds if seeds is not None else [0] * len(observations),
                                        per_frame)
        if per_frame <= 1:
            return [[i] for i in range(len(observations))]
        groups: dict[tuple, list[int]] = {}
        for i, o in enumerate(observations):
            key = (tuple(sorted((k, v.shape) for k, v in o.images.items())),
                   None if o.state is None else o.state.shape[0])
            groups.setdefault(key, []).append(i)
        return [idx[k:k + per_frame] for idx in groups.values() for k in range(0, len(idx), per_frame)]

    async def predict(self, observations: Sequence[Observation], seeds: Sequence[int] | None = None,
                      parameters: dict[str, Any] | None = None) -> np.ndarray:
        """(N, H, D) float32 action chunks for N observations, in order."""
        n = len(observations)
        seeds = checked_seeds(n, seeds)
        params = {**self.parameters, **(parameters or {})}
        rad = params.get("raw_action_dim", self.raw_action_dim)
        await self.max_request_size()
        plan = self.plan(observations, self._per_frame or 1, seeds)
        timings: list[dict[str, Any]] = []
        results = await asyncio.gather(*(self._send([observations[i] for i in idx], [seeds[i] for i in idx],
                                                    params, rad, timings) for idx in plan))
        out = scatter_chunks(n, plan, results)
        timings.sort(key=lambda t: t["t_send"])
        self.last_timings = timings
        if self.action_horizon:
            out = out[:, : int(self.action_horizon)]
        if self.postprocess is not None:
            out = np.asarray(self.postprocess(out), np.float32)
        return out

    async def _send(self, obs: list[Observation], seeds: list[int], params: dict[str, Any], rad: int | None,
                    timings: list[dict[str, Any]]) -> np.ndarray:
        body, rid = self.codec.body(obs, seeds, params, self.send_seed, self._native)
        slots = self._slots
        if slots is None:
            frame = packb(body)
            reply, attempts, nbytes, t_send, t_recv = await self._exchange(frame)
        else:   # the arrays into a shared-memory slot, kept until the reply is in (dropped if none comes)
            frame, slot = slots.pack(body)
            ok = False
            try:
                reply, attempts, nbytes, t_send, t_recv = await self._exchange(frame)
                ok = True
            except ActionClientError as e:
                if e.status != 400 or SHM_UNREADABLE not in str(e):
                    raise
                # the server cannot see this host's slots (another /dev/shm): arrays inline from now on
                self._slots, self.shm_used = None, False
                frame = packb(body)
                reply, attempts, nbytes, t_send, t_recv = await self._exchange(frame)
            finally:
                slots.done(slot, ok)
                if self._slots is None and slots is not None:
                    slots.close()
        try:
            actions, server = self.codec.decode(reply, rad, len(obs))
        except ProtocolError as e:
            raise ActionClientError(f"{self.url}: bad reply: {e}") from None
        rec = {"request_id": rid, "n": len(obs), "t_send": t_send, "t_recv": t_recv,
               "client_ms": round((t_recv - t_send) * 1000.0, 3), "attempts": attempts,
               "request_bytes": len(frame), "response_bytes": nbytes, "server": server}
        timings.append(rec)
        if self.on_timing is not None:
            self.on_timing(rec)
        return actions


def _denial_text(response: Any) -> str:
    body = getattr(response, "body", b"") or b""
    try:
        j = json.loads(body)
        if isinstance(j, dict) and isinstance(j.get("error"), dict):
            return str(j["error"].get("message"))
    except ValueError:
        pass
    return body[:300].decode("utf-8", "replace")
