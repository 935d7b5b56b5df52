"""The action server: Starlette app over a policy and a dynamic batcher (run on uvicorn by `wamkit serve`).

Routes
- ``GET  /health``                    200 {"status": "ok", "instance_id": ...} (503 once the policy child died, or
                                      "shutting_down" in the moment between SIGTERM and the listener's close, after
                                      which new connections are refused: ActionServer.health_state, /healthz's fact
                                      too); never needs the token. instance_id: env WAMKIT_INSTANCE_ID of this process
                                      (null if unset): a server worker checks it to prove the answer comes from the
                                      server it started.
- ``GET  /v1/actions/metadata``       policy spec, max batch size, action dim/horizon (SGLang's metadata layout).
- ``POST /v1/actions/generations``    SGLang's action API (+ wamkit extensions), JSON or msgpack; envelope, or
                                      SGLang's raw output for runtime.response_format "raw".
- ``GET  /metrics``                   JSON: counts, batch-size histogram, queue/compute p50/p99 (Prometheus text when
                                      Accept asks for text/plain or OpenMetrics).
- ``GET  /metrics/prometheus``        the same in the Prometheus text format (0.0.4).
- ``WS   /openpi/policy``, ``/``, ``/v1/actions/realtime``, ``GET /healthz``: openpi / SGLang websockets (serve.ws).

Token: ``Authorization: Bearer <token>`` or openpi's ``Api-Key <token>`` on every route but /health (one check,
serve.errors.token_accepted, for HTTP and websockets); with a token, an unknown route or a wrong method answers 401
before 404/405, so the routes cannot be listed without it.
Errors answer ``{"error": {"message", "type", "path", "code"}, "detail": message}``: 400 malformed (the message names
the field path), 401 bad/missing token, 408 body not received within body_timeout_s, 413 body or decoded images too
large, 415 content type, 422 valid but unsupported here (also: the policy's own input check refused it, a UserError
from predict), 500 the policy failed (its exception's type and text, without absolute paths or object addresses:
serve.errors.failure_message; the log has them whole), 503 queue full, the decoded images of the requests held over
max_inflight_decoded_mb (serve.inflight) or shutting down (with Retry-After; also a request still in
flight when graceful_timeout_s runs out), 404 unknown route, 405 wrong method (Starlette's own refusals, through
create_app's exception handler). Decoding a request never answers 5xx: an unexpected error while decoding is a 400
(and counted in /metrics as decode_unexpected). Requests are never unpickled: JSON or msgpack without extension types
only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wamkit.core.cpu_pinning import torch_threads
from wamkit.core.errors import UserError
from wamkit.policies.base import Policy
from wamkit.policies.catalog import check_built
from wamkit.policies.checks import PolicyOutputError, observation_problem
from wamkit.protocol import ProtocolError, build_response, decode_body, encode_body, is_msgpack, parse_request
from wamkit.protocol.messages import ActionRequest, build_raw_response
from wamkit.protocol.errors import POLICY_OUTPUT_ERROR
from wamkit.protocol.limits import ImageBudget
from wamkit.protocol.sglang import sglang_parameter_refusal
from wamkit.protocol.shm import ShmReader
from wamkit.protocol.shm import available as shm_available
from wamkit.serve.batcher import DynamicBatcher, QueueFull
from wamkit.serve.config import INSTANCE_ENV, ServeConfig
from wamkit.serve.metadata import default_steps, metadata_of
from wamkit.serve.metrics import PROMETHEUS_CONTENT_TYPE, ServerMetrics, wants_prometheus
from wamkit.serve.errors import OFFLOAD_BYTES, error_response, failure_message, token_accepted
from wamkit.serve.inflight import DecodedBytes, DecodedBytesFull
from wamkit.serve.ws import websocket_routes

log = logging.getLogger("wamkit.serve")


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, path: str = "", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.path, self.headers = status, message, path, headers or {}




def served_max_batch_size(cfg: ServeConfig, policy: Policy) -> int:
    """The server's max_batch_size (the most observations one policy.predict call gets, what metadata reports as
    capabilities.max_batch_size): the configured one (0: the policy's own), never above the policy's."""
    pmax = int(policy.max_batch_size())
    return min(cfg.max_batch_size, pmax) if cfg.max_batch_size > 0 else pmax


class ActionServer:
    """State behind the routes: the policy, the batcher, metrics, limits."""

    def __init__(self, cfg: ServeConfig, policy: Policy):
        self.cfg = cfg
        self.policy = policy
        self.spec = policy.spec
        self.max_batch_size = served_max_batch_size(cfg, policy)
        self.max_body = int(cfg.max_body_mb * 1024 * 1024)
        # shared-memory arrays (protocol/shm.py): a slot holds at most one frame's worth of arrays
        self.limits = cfg.decode_limits()
        self.shm = (ShmReader(self.max_body, self.limits.max_decoded_bytes) if cfg.shm_arrays and shm_available()
                    else None)
        self.instance_id = os.environ.get(INSTANCE_ENV) or None
        self.token = cfg.resolved_token()
        self.model = cfg.model_name or self.spec.name
        self.metrics = ServerMetrics()
        # concurrent_batches > 1: one replica per extra lane (Policy.replica; a policy without it is refused here)
        self.replicas = [policy] + [policy.replica() for _ in range(cfg.concurrent_batches - 1)]
        self.batcher = DynamicBatcher([p.predict for p in self.replicas], self.max_batch_size, cfg.max_wait_ms,
                                      cfg.max_queue, self.metrics, max_wait_fraction=cfg.max_wait_fraction,
                                      idle_dispatch=cfg.idle_dispatch, check_output=self.spec)
        self.decoded = DecodedBytes(cfg.inflight_decoded_bytes(), self.batcher.retry_after_s)
        self.decode_pool = ThreadPoolExecutor(max_workers=cfg.decode_threads, thread_name_prefix="wamkit-decode")
        self._log_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def begin_shutdown(self) -> None:
        """Thread/signal-safe: stop taking new work and flush queued observations into batches now (SIGTERM: the
        in-flight requests are answered while uvicorn waits for them)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.batcher.begin_close)

    # ------------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.loop = asyncio.get_running_loop()
        await self.batcher.start()
        if self.cfg.log_every_s > 0:
            self._log_task = asyncio.create_task(self._log_loop())
        try:
            yield
        finally:
            if self._log_task is not None:
                self._log_task.cancel()
            await self.batcher.close()          # runs whatever is still queued
            self.decode_pool.shutdown(wait=False)
            with contextlib.suppress(Exception):
                self.policy.close()

    async def _log_loop(self) -> None:
        last = -1
        while True:
            await asyncio.sleep(self.cfg.log_every_s)
            s = self.metrics.snapshot()
            n = s["counts"].get("observations_computed", 0)
            if n != last:
                last = n
                print(f"[wamkit serve] obs={n} batches={s['counts'].get('batches', 0)} "
                      f"mean_batch={s['mean_batch_size']} queue_ms p50={s['queue_ms']['p50']} "
                      f"p99={s['queue_ms']['p99']} compute_ms p50={s['compute_ms']['p50']} "
                      f"queued={self.batcher.queued}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ helpers
    def _check_token(self, request: Request) -> None:
        if not token_accepted(self.token, request.headers.get("authorization", "")):
            raise _HTTPError(401, "missing or invalid token (Authorization: Bearer <token> or Api-Key <token>)",
                             headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, request: Request) -> bytes:
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise _HTTPError(400, "invalid content-length") from None
            if n > self.max_body:
                raise _HTTPError(413, f"body of {n} bytes exceeds the cap of {self.max_body} bytes "
                                      f"(max_body_mb={self.cfg.max_body_mb})", headers={"Connection": "close"})
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body:
                        raise _HTTPError(413, f"body exceeds the cap of {self.max_body} bytes (max_body_mb="
                                              f"{self.cfg.max_body_mb})", headers={"Connection": "close"})
                    chunks.append(chunk)
        except ClientDisconnect:
            raise _HTTPError(400, "client disconnected before sending the whole body") from None
        except TimeoutError:
            self.metrics.count("body_timeouts")
            raise _HTTPError(408, f"body not received within body_timeout_s={self.cfg.body_timeout_s}",
                             headers={"Connection": "close"}) from None
        return b"".join(chunks)

    def _check_against_policy(self, req: ActionRequest) -> None:
        a = self.spec.action
        p = req.parameters
        horizon_path = f"parameters.{req.horizon_source}"   # num_frames when the horizon came from it
        if self.spec.extra.get("request_rules") == "sglang":   # answering in SGLang's place: refuse what it refuses
            refusal = sglang_parameter_refusal(p)
            if refusal is not None:
                path = horizon_path if refusal[0] == "parameters.action_horizon" else refusal[0]
                raise ProtocolError(path, refusal[1])
            if len(req) > self.max_batch_size:
                raise ProtocolError("input.image", f"{len(req)} observations exceed the server's max batch size "
                                                   f"{self.max_batch_size} (SGLang's --batching-max-size)")
        if p.get("action_horizon", 0) > a.horizon:
            raise ProtocolError(horizon_path, f"action_horizon {p['action_horizon']} > this policy's horizon "
                                              f"{a.horizon}", status=422)
        if p.get("raw_action_dim", 0) > a.dim:
            raise ProtocolError("parameters.raw_action_dim", f"{p['raw_action_dim']} > this policy's action dim "
                                                             f"{a.dim}", status=422)
        if p.get("action_dim", a.dim) != a.dim:
            raise ProtocolError("parameters.action_dim", f"this policy's action dim is {a.dim}", status=422)
        for i, o in enumerate(req.observations):   # the rule in-process evaluation applies too (policies.checks)
            if (problem := observation_problem(self.spec, o, i)) is not None:
                raise ProtocolError(*problem, status=422)

    def image_budget(self, ticket) -> ImageBudget:
        """A request's image budget: max_decoded_mb for it, its bytes also taken from the server's (its ticket)."""
        return ImageBudget(self.limits, ticket)

    def _decode(self, body: bytes, content_type: str, budget: ImageBudget) -> ActionRequest:
        try:
            return parse_request(decode_body(body, content_type, self.limits.max_depth, self.limits.max_containers),
                                 self.limits, budget)
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - bad input must never be a 5xx; counted so tests can catch the gap
            self.metrics.count("decode_unexpected")
            log.warning("unexpected error decoding a request: %s: %s", type(e).__name__, e)
            raise ProtocolError("", f"malformed request ({type(e).__name__})") from None

    # ------------------------------------------------------------------ routes
    def health_state(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of the server's health: the one fact /health (JSON) and openpi's /healthz (text) both
        answer. 503 while shutting down, and with policy_process=true once the policy child has died: it fails every
        request from then on, so the server is not healthy (a server worker, the eval's, restarts it on this 503)."""
        if self.batcher.closing:
            return 503, {"status": "shutting_down", "instance_id": self.instance_id}
        code = self.policy_exit_code()
        if code is not None:
            return 503, {"status": "policy_process_exited", "exit_code": code, "instance_id": self.instance_id}
        return 200, {"status": "ok", "instance_id": self.instance_id}

    def policy_exit_code(self) -> int | None:
        """The exit code of a policy child process that died (policy_process=true); None while every one runs."""
        dead = [code for code in (getattr(p, "exitcode", None) for p in self.replicas) if code is not None]
        return dead[0] if dead else None

    def log_failure(self, e: Exception, what: str) -> None:
        """A request the policy failed (answered 500): its traceback, or one line when the policy child has died
        (every request fails the same way from then on; /health says so)."""
        code = self.policy_exit_code()
        if code is None:
            log.exception("%s failed", what)
        else:
            log.error("%s failed: policy process exited (exit code %s): %s: %s", what, code, type(e).__name__, e)

    def cancelled_at_shutdown(self) -> Response:
        """The answer of a request still in flight when graceful_timeout_s ran out after SIGTERM, which uvicorn cancels
        (logging one line for all of them): 503 + Retry-After, as for any request refused while shutting down, instead
        of a plain-text 500 and a traceback each. The request's task then ends normally (Task.uncancel)."""
        asyncio.current_task().uncancel()
        return error_response(503, "server is shutting down (graceful_timeout_s ran out before the answer)",
                              headers={"Retry-After": "1"})

    async def health(self, request: Request) -> Response:
        status, body = self.health_state()
        return JSONResponse(body, status_code=status)

    def denoise_steps(self, req: ActionRequest) -> int:
        """usage.denoise_steps: the steps that ran: the policy's own where it says (spec.extra.num_inference_steps;
        a request's num_inference_steps does not reach predict, so it was echoed for steps that never ran), else
        the request's value, else 0."""
        own = default_steps(self.spec)
        return own if own is not None else req.parameters.get("num_inference_steps", 0)

    def metadata_dict(self) -> dict[str, Any]:
        return metadata_of(self)

    async def metadata(self, request: Request) -> Response:
        self._check_token(request)
        return JSONResponse(self.metadata_dict())

    async def metrics_route(self, request: Request) -> Response:
        """JSON; Prometheus text at /metrics/prometheus, or at /metrics when Accept asks for text/plain or OpenMetrics
        (what a Prometheus scrape sends)."""
        self._check_token(request)
        gauges = dict(queued=self.batcher.queued, max_batch_size=self.max_batch_size, max_wait_ms=self.cfg.max_wait_ms,
                      refill_window_ms=round(self.batcher.refill_window_s() * 1000.0, 3),
                      inflight_decoded_bytes=self.decoded.used)
        if request.url.path.endswith("/prometheus") or wants_prometheus(request.headers.get("accept", "")):
            return Response(self.metrics.prometheus(**gauges), media_type=PROMETHEUS_CONTENT_TYPE)
        return JSONResponse(self.metrics.snapshot(**gauges))

    async def generations(self, request: Request) -> Response:
        t0 = time.perf_counter()
        self.metrics.count("requests")
        self._check_token(request)
        ct = request.headers.get("content-type", "")
        binary = is_msgpack(ct) or "msgpack" in request.headers.get("accept", "").lower()
        # idle dispatch waits for requests in intake (wamkit.serve.batcher); the block ends right before submit.
        # The ticket holds the request's decoded images against max_inflight_decoded_mb until it is answered
        with self.decoded.ticket() as ticket:
            with self.batcher.intake():
                body = await self._read_body(request)
                budget = self.image_budget(ticket)
                if len(body) > OFFLOAD_BYTES:
                    req = await asyncio.get_running_loop().run_in_executor(self.decode_pool, self._decode, body, ct,
                                                                           budget)
                else:
                    req = self._decode(body, ct, budget)
                n = len(req)
                if n > self.cfg.max_queue:
                    raise _HTTPError(413, f"{n} observations in one request; the server queues at most "
                                          f"{self.cfg.max_queue}", path="input")
                self._check_against_policy(req)
                keys = [req.group_key(i) for i in range(n)]
            self.metrics.count("observations", n)
            actions, timing = await self.batcher.submit(req.observations, req.seeds, keys)
            if req.runtime.response_format == "raw":   # SGLang's pipeline output as it is
                out = build_raw_response(req, actions, binary, timing=timing, denoise_steps=self.denoise_steps(req))
            else:
                out = build_response(req, actions, self.model, binary, timing=timing,
                                     denoise_steps=self.denoise_steps(req))
        data, media = encode_body(out, binary)
        self.metrics.response(200, (time.perf_counter() - t0) * 1000.0)
        return Response(data, media_type=media)


def create_app(cfg: ServeConfig, policy: Policy | None = None) -> Starlette:
    """The Starlette app for `cfg` (the policy is built from cfg.policy / cfg.policy_args unless given)."""
    if policy is None:
        from wamkit.core.device import resolve_device

        kwargs = {"device": resolve_device(cfg.device), **cfg.policy_args}
        if cfg.policy_process:  # the policy's GIL is not the event loop's (wamkit.serve.policy_process)
            from wamkit.serve.policy_process import PolicyProcess

            policy = PolicyProcess(cfg.policy, kwargs, cfg.torch_threads)
        else:
            from wamkit.policies import make_policy

            policy = make_policy(cfg.policy, **kwargs)
    else:   # given by the caller (tests, an embedding program): checked as make_policy checks what it builds
        check_built(policy, cfg.policy)
    if "torch" in sys.modules:  # only policies that use torch have imported it
        import torch

        torch.set_num_threads(torch_threads(cfg.torch_threads))
    srv = ActionServer(cfg, policy)
    if cfg.warmup:  # before uvicorn listens: /health answers only once the one-off work is done
        t0 = time.perf_counter()
        done: dict[str, float] = {}
        for i, rep in enumerate(srv.replicas):   # each replica captures its own graphs (one after the other)
            for k, v in rep.warmup(srv.max_batch_size).items():
                done[k if i == 0 else f"replica {i} {k}"] = v
        if done:
            log.warning("warm-up done in %.1f s (%s)", time.perf_counter() - t0,
                        ", ".join(f"{k}: {v:.1f} s" for k, v in done.items()))

    def guarded(fn):
        async def handler(request: Request) -> Response:
            try:
                return await fn(request)
            except (QueueFull, DecodedBytesFull) as e:
                srv.metrics.count("rejected_busy")
                resp = error_response(503, str(e), headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))})
            except ProtocolError as e:
                resp = error_response(e.status, str(e), e.path)
            except _HTTPError as e:
                resp = error_response(e.status, e.message, e.path, e.headers)
            except UserError as e:  # the policy refused this request's input (its own check): not the server's fault
                resp = error_response(422, str(e), "input")
            except Exception as e:  # the policy failed: answer 500, keep serving
                srv.log_failure(e, "request")
                resp = error_response(500, failure_message(e),
                                      kind=POLICY_OUTPUT_ERROR if isinstance(e, PolicyOutputError) else None)
            except asyncio.CancelledError:
                if not srv.batcher.closing:   # not uvicorn's end of the graceful shutdown: not ours to answer
                    raise
                resp = srv.cancelled_at_shutdown()
            srv.metrics.response(resp.status_code)
            return resp
        return handler

    async def http_error(request: Request, exc: HTTPException) -> Response:
        """Starlette's own refusals (404 unknown route, 405 wrong method) in the error layout of every route; with a
        token, only to a request that carries it (401 otherwise, as on the routes)."""
        try:
            srv._check_token(request)
        except _HTTPError as e:
            srv.metrics.response(e.status)
            return error_response(e.status, e.message, headers=e.headers)
        path, message = request.url.path, exc.detail
        if exc.status_code == 404:
            message = f"no such route: {path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {path} (allowed: {(exc.headers or {}).get('Allow')})"
        srv.metrics.response(exc.status_code)
        return error_response(exc.status_code, message, headers=exc.headers)

    routes = [Route("/health", srv.health, methods=["GET"]),
              Route("/v1/actions/metadata", guarded(srv.metadata), methods=["GET"]),
              Route("/v1/actions/generations", guarded(srv.generations), methods=["POST"]),
              Route("/metrics", guarded(srv.metrics_route), methods=["GET"]),
              Route("/metrics/prometheus", guarded(srv.metrics_route), methods=["GET"])]
    routes += websocket_routes(srv)  # openpi's policy websocket, SGLang's /v1/actions/realtime (wamkit.serve.ws)
    app = Starlette(routes=routes, lifespan=srv.lifespan, exception_handlers={HTTPException: http_error})
    app.state.server = srv
    return app
