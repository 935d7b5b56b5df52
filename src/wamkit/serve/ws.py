"""Websocket routes of `wamkit serve`: openpi's policy protocol and SGLang's realtime action websocket.

Routes (registered by wamkit.serve.app.create_app; frames per wamkit.protocol.openpi)
- ``WS  /openpi/policy`` and ``WS /``   openpi's protocol (what ``openpi_client.WebsocketClientPolicy`` speaks; plain
                                        openpi clients connect to ``/``): replies ``{"actions", "server_timing"}``.
- ``WS  /v1/actions/realtime``          SGLang's realtime route: replies the envelope of ``POST
                                        /v1/actions/generations`` (values as arrays) plus ``server_timing``.
- ``GET /healthz``                      openpi's health check: 200 ``OK``; 503 when ``GET /health`` is 503
                                        (shutting down, or the policy child process died), as text.

Every connection gets the metadata frame first (``GET /v1/actions/metadata``'s document), then one reply per
request frame, in order. Observations from every connection (and from HTTP requests) go through the one dynamic
batcher, so concurrent connections share batches. Same token (``Authorization: Bearer <token>``, or openpi's
``Api-Key <token>``; a refused handshake answers 401), same limits (a frame is at most max_body_mb and
max_containers; the queue bound and max_inflight_decoded_mb answer 503 with ``retry_after_s``). A handshake that
carries an ``Origin`` header (a browser page) is refused with 403 unless allowed_origins lists it: non-browser
clients (openpi's, websockets', wamkit's) send none. A connection without a frame for ws_idle_timeout_s is closed
(1000). ``server_timing``: ``infer_ms`` (frame decoded -> actions ready),
``prev_total_ms`` (the previous request's frame received -> reply sent), and wamkit's queue/compute split.
A bad frame is answered with the HTTP API's error body (``{"error": {"message", "type", "path", "code"}, "detail"}``):
as a text frame on the openpi routes (openpi's client raises it as an error), as a msgpack frame on the realtime
route; the connection stays open and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from wamkit.core.errors import UserError
from wamkit.protocol import ProtocolError, build_response, parse_request
from wamkit.protocol.limits import ImageBudget
from wamkit.protocol.messages import ActionRequest
from wamkit.protocol.shm import refuse as refuse_shm
from wamkit.protocol.openpi import bytes_keyed_marker, is_action_request, openpi_request, packb, unpackb
from wamkit.serve.batcher import QueueFull
from wamkit.serve.errors import OFFLOAD_BYTES, error_response, failure_message, token_accepted
from wamkit.serve.inflight import DecodedBytesFull


OPENPI_PATHS = ("/openpi/policy", "/")
REALTIME_PATH = "/v1/actions/realtime"


class _FrameError(Exception):
    def __init__(self, status: int, message: str, path: str = ""):
        super().__init__(message)
        self.status, self.message, self.path = status, message, path


def _error_body(status: int, message: str, path: str = "", retry_after_s: float | None = None) -> dict[str, Any]:
    body = json.loads(error_response(status, message, path).body)   # the HTTP API's layout, for both transports
    if retry_after_s is not None:
        body["error"]["retry_after_s"] = retry_after_s
    return body


def _token_ok(srv: Any, ws: WebSocket) -> bool:
    return token_accepted(srv.token, ws.headers.get("authorization", ""))   # the HTTP routes' check


def origin_allowed(origin: str | None, allowed: list[str], host: str | None = None) -> bool:
    """A handshake without Origin (not a browser) is allowed; one with it when its host[:port] is the request's
    own Host (the same origin: clients such as websocket-client send that by default; a loopback-bound server has
    already refused a Host that is not loopback) or when `allowed` lists it (any case, a trailing / ignored) or
    holds "*"."""
    if origin is None:
        return True
    want = origin.strip().rstrip("/").lower()
    if host and want.split("://", 1)[-1] == host.strip().lower():
        return True
    return any(a == "*" or a.strip().rstrip("/").lower() == want for a in allowed)


def _parse(body: dict[str, Any], budget: ImageBudget) -> tuple[ActionRequest, bool]:
    """A decoded frame -> (request, True if it was one openpi observation dict), under the server's decode limits
    (the same as its HTTP route's: one image budget per frame, text and nesting caps)."""
    if is_action_request(body):
        return parse_request(body, budget.limits, budget), False
    return openpi_request(body, budget.limits, budget), True   # with the frame's parameters, as SGLang reads them


def _openpi_path(path: str) -> str:
    """A field path of the HTTP request form -> the openpi observation key (input.images[0].wrist_image ->
    observation/wrist_image, input.state[0].shape -> observation/state.shape, parameters.action_horizon ->
    action_horizon: a frame carries its parameters as keys of its own)."""
    for http, openpi in (("input.images[0].", "observation/"), ("input.state[0]", "observation/state"),
                         ("parameters.", "")):
        if path.startswith(http):
            return openpi + path[len(http):]
    return path


class _Connection:
    """One websocket client: reads frames one at a time and answers each (requests of one connection are answered in
    order; concurrency comes from several connections, whose observations meet in the batcher)."""

    def __init__(self, srv: Any, ws: WebSocket, envelope: bool):
        self.srv, self.ws, self.envelope = srv, ws, envelope
        self.prev_total_ms: float | None = None
        # arrays by reference (protocol/shm.py): a server that offers them, a client on this host
        client = ws.client
        local = client is not None and client.host in ("127.0.0.1", "::1")
        self.shm = getattr(srv, "shm", None) if local else None

    async def run(self) -> None:
        srv = self.srv
        origin = self.ws.headers.get("origin")
        if not origin_allowed(origin, srv.cfg.allowed_origins, self.ws.headers.get("host")):   # a page elsewhere
            await self._refuse(403, f"websocket Origin {origin[:100]!r} is not allowed (server allowed_origins)")
            return
        if not _token_ok(srv, self.ws):
            await self._refuse(401, "missing or invalid bearer token")
            return
        if srv.batcher.closing:
            await self._refuse(503, "server is shutting down")
            return
        await self.ws.accept()
        srv.metrics.count("ws_connections")
        await self.ws.send_bytes(packb(srv.metadata_dict()))
        idle_s = srv.cfg.ws_idle_timeout_s or None
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    msg = await self.ws.receive()
            except TimeoutError:   # no frame for ws_idle_timeout_s: a normal close
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await self.ws.close(code=1000, reason=f"idle for {idle_s:g} s (server ws_idle_timeout_s)")
                return
            if msg["type"] == "websocket.disconnect":
                return
            t0 = time.perf_counter()
            reply = await self._answer(msg, t0)
            try:
                if isinstance(reply, str):
                    await self.ws.send_text(reply)
                else:
                    await self.ws.send_bytes(reply)
            except (WebSocketDisconnect, RuntimeError, OSError):  # the client went away before its reply
                return
            self.prev_total_ms = round((time.perf_counter() - t0) * 1000.0, 3)

    async def _refuse(self, status: int, message: str) -> None:
        body = json.dumps(_error_body(status, message)).encode()
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        self.srv.metrics.count("requests")   # a refused handshake is a request answered with its status
        self.srv.metrics.response(status)
        if "websocket.http.response" in self.ws.scope.get("extensions", {}):
            await self.ws.send_denial_response(Response(body, status_code=status, media_type="application/json",
                                                        headers=headers))
        else:  # an ASGI server without denial responses: refuse the handshake (HTTP 403)
            await self.ws.close(code=1008, reason=message)

    async def _answer(self, msg: dict[str, Any], t0: float) -> bytes | str:
        srv = self.srv
        srv.metrics.count("requests")   # every frame is one request with one response, as on HTTP: the books balance
        try:
            return await self._infer(msg, t0)
        except (QueueFull, DecodedBytesFull) as e:
            srv.metrics.count("rejected_busy")
            status, body = 503, _error_body(503, str(e), retry_after_s=round(e.retry_after_s, 3))
        except ProtocolError as e:
            status, body = e.status, _error_body(e.status, str(e), e.path)
        except _FrameError as e:
            status, body = e.status, _error_body(e.status, e.message, e.path)
        except UserError as e:  # the policy refused this frame's input (its own check)
            status, body = 422, _error_body(422, str(e), "input")
        except Exception as e:  # the policy failed: answer 500, keep serving
            srv.log_failure(e, "websocket request")
            status, body = 500, _error_body(500, failure_message(e))
        srv.metrics.response(status)
        return packb(body) if self.envelope else json.dumps(body)

    async def _infer(self, msg: dict[str, Any], t0: float) -> bytes:
        srv = self.srv
        data = msg.get("bytes")
        if data is None:
            raise _FrameError(400, "send binary msgpack frames (text frames are not read)")
        if len(data) > srv.max_body:
            raise _FrameError(413, f"frame of {len(data)} bytes exceeds the cap of {srv.max_body} bytes "
                                   f"(max_body_mb={srv.cfg.max_body_mb})")
        # the ticket holds the frame's decoded images against max_inflight_decoded_mb until it is answered
        with srv.decoded.ticket() as ticket:
            return await self._infer_held(data, t0, srv.image_budget(ticket))

    async def _infer_held(self, data: bytes, t0: float, budget: ImageBudget) -> bytes:
        srv = self.srv
        limits = srv.limits
        # idle dispatch waits for requests in intake, as on the HTTP route (a frame is whole by now: this covers its
        # decode, which runs off the event loop for large frames)
        with srv.batcher.intake():   # the block ends right before submit
            if len(data) > OFFLOAD_BYTES:
                body = await asyncio.get_running_loop().run_in_executor(srv.decode_pool, unpackb, data,
                                                                          limits.max_depth, limits.max_containers)
            else:
                body = unpackb(data, limits.max_depth, limits.max_containers)
            if self.shm is not None:
                body = self.shm.resolve(body)
            else:
                refuse_shm(body)
            ctrl = body.get("__ctrl__")
            if ctrl is not None:  # openpi's episode_start / episode_end notifications: nothing to do but acknowledge
                srv.metrics.response(200)
                return packb({"__ack__": ctrl if ctrl in ("episode_start", "episode_end") else "ignored"})
            req, single = _parse(body, budget)
            n = len(req)
            if n > srv.cfg.max_queue:
                raise _FrameError(413, f"{n} observations in one frame; the server queues at most "
                                       f"{srv.cfg.max_queue}", path="input")
            try:
                srv._check_against_policy(req)
            except ProtocolError as e:   # name the field as the client sent it
                raise ProtocolError(_openpi_path(e.path) if single else e.path, e.message, e.status) from None
            keys = [req.group_key(i) for i in range(n)]
        srv.metrics.count("observations", n)
        actions, timing = await srv.batcher.submit(req.observations, req.seeds, keys)
        server_timing: dict[str, Any] = {"infer_ms": round((time.perf_counter() - t0) * 1000.0, 3)}
        if self.prev_total_ms is not None:
            server_timing["prev_total_ms"] = self.prev_total_ms
        server_timing.update(timing)
        if self.envelope:
            out = build_response(req, actions, srv.model, True, timing=timing, denoise_steps=srv.denoise_steps(req))
            for item in out["data"]:   # runtime.output_format=list leaves lists as they are
                v = item["action"]["values"]
                if isinstance(v, dict):
                    item["action"]["values"] = bytes_keyed_marker(v)
            out["server_timing"] = server_timing
        else:
            p = req.parameters
            acts = np.asarray(actions, np.float32)
            if p.get("action_horizon"):
                acts = acts[:, : p["action_horizon"]]
            if p.get("raw_action_dim"):
                acts = acts[:, :, : p["raw_action_dim"]]
            out = {"actions": acts[0] if single else acts, "server_timing": server_timing}
        srv.metrics.response(200, (time.perf_counter() - t0) * 1000.0)
        return packb(out)


def websocket_routes(srv: Any) -> list:
    """The websocket routes (and openpi's /healthz) over the ActionServer `srv`."""

    async def openpi(ws: WebSocket) -> None:
        await _Connection(srv, ws, envelope=False).run()

    async def realtime(ws: WebSocket) -> None:
        await _Connection(srv, ws, envelope=True).run()

    async def healthz(request: Request) -> Response:
        status, body = srv.health_state()    # the fact /health answers, as openpi's text
        if status == 200:
            return PlainTextResponse("OK\n")
        detail = f" (exit code {body['exit_code']})" if "exit_code" in body else ""
        return PlainTextResponse(f"{body['status'].replace('_', ' ')}{detail}\n", status_code=status)

    return [*(WebSocketRoute(p, openpi) for p in OPENPI_PATHS), WebSocketRoute(REALTIME_PATH, realtime),
            Route("/healthz", healthz, methods=["GET"])]
