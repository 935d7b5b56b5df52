"""Async action client for a wamkit or SGLang action server.

    async with ActionClient(url) as c:
        actions = await c.predict(observations, seeds)          # float32 (N, H, D), in observation order

What it does per predict():
1. groups observations that may share a server batch (wamkit: same cameras/shapes/state length; sglang: same prompt
   text and image shape, optionally same seed), splits groups into requests of at most `max_request_size` (default: the
   server's metadata `capabilities.max_batch_size`);
2. sends all requests concurrently over one pooled httpx.AsyncClient (msgpack + raw uint8 arrays by default);
3. retries connection errors, timeouts, 5xx and 429 with exponential backoff + jitter, honouring Retry-After (up to
   RETRY_AFTER_MAX_S): at least `retries` times, and while the server is unreachable or unavailable (no answer,
   429/502/503/504) for at least `retry_s` seconds (an outage budget: a server being restarted elsewhere), each
   first retry of an outage logged; 4xx (and 3xx: a url that redirects is the wrong url)
   raise at once (ActionClientError, one line naming the server and the server's message naming the field; 401/403
   as ActionAuthError, a UserError);
4. reads at most max_answer_mb of an answer (decoded; a longer one is AnswerTooLong, not retried), sorts each
   response by input_index, keeps the first raw_action_dim channels, scatters chunks back into order, then
   applies `postprocess` (e.g. a denormalizer) to the (N, H, D) array.
mode="wamkit" sends wamkit's request forms (several cameras and states per request, one seed per observation) only to a
server whose metadata says it is wamkit (`server.name`); any other server gets only forms SGLang accepts
(wamkit.protocol.sglang.plan_sglang_requests / build_sglang_observation_request: one seed a request, so observations
are grouped by seed, prompt and shapes; SGLang's batch form `input.images = {camera: [image] * N}` for one camera
without state, else one observation a request, requests sent concurrently). The same seeds give the same actions
whatever the grouping.
Every request's timing (client send/receive wall times + the server's `timing` extension) is appended to
`last_timings` (the latest predict() call) and passed to `on_timing` if given (for the evaluation timeline).

mode="sglang" encodes per SGLang's contract: one camera image per observation (`camera`), one prompt text and one seed
per request, so observations are grouped by (prompt, image shape, seed): every observation is computed with its own
seed, exactly (callers that want full batches send one seed for all, as the Cosmos3 adapter does by default). The
batch limit comes from the server's metadata (`capabilities.max_batch_size`; 1 when `batch_inputs` is false or the
metadata route is missing), and every request is checked against SGLang's rules before it is sent
(wamkit.protocol.sglang.check_sglang_request): a request SGLang would refuse is refused here first, with the field.
SGLang returns normalized actions in policy mode unless it has stats: pass `postprocess`.

This is the one HTTP client of the action contract: the evaluation's server inference and the Cosmos3 adapter both use
it (it lives in the protocol layer, below the policies).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from wamkit.core.errors import RunError, UserError
from wamkit.core.lifecycle import ClosingContext
from wamkit.core.types import Observation
from wamkit.protocol import (MSGPACK, ProtocolError, build_request, build_sglang_request, check_sglang_request,
                             decode_body, encode_body, parse_response, sglang_parameters)
from wamkit.protocol.errors import POLICY_OUTPUT_ERROR
from wamkit.protocol.messages import DEFAULT_CAMERA
from wamkit.protocol.sglang import build_sglang_observation_request, is_wamkit_server, plan_sglang_requests

RETRY_STATUS = frozenset((429, 500, 502, 503, 504))
UNAVAILABLE_STATUS = frozenset((429, 502, 503, 504))   # the server is not there (yet): retried for retry_s too; a
                                                       # 500 (the policy failed) only `retries` times
AUTH_STATUS = frozenset((401, 403))
RETRY_AFTER_MAX_S = 30.0   # a longer Retry-After (a proxy's 3600) is waited out in steps of this, within retry_s

log = logging.getLogger("wamkit.client")


class ActionClientError(RunError):
    """The server refused a request (4xx), answered something unusable, or retries ran out: one line naming the
    server (the CLI prints it, exit 1). status: HTTP status (None: connection failure)."""

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status, self.body = status, body


class ActionAuthError(ActionClientError, UserError):
    """401/403: the token is missing or wrong (exit 2: the user's setting, not the run)."""


def client_error(url: str, what: str, status: int | None, body: Any = None) -> ActionClientError:
    """The error for a refused request: ActionAuthError (with the settings to check) for 401/403."""
    if status in AUTH_STATUS:
        return ActionAuthError(f"{url}: {what} (check server.token, or the WAMKIT_TOKEN environment variable)",
                               status, body)
    return ActionClientError(f"{url}: {what}", status, body)


MAX_ANSWER_MB = 256.0   # ActionClient(max_answer_mb=): the most of one answer it reads (a 1024-observation JSON answer
                        # of 64 x 32 actions is ~40 MB); a longer one is refused, not read into memory


class AnswerTooLong(ActionClientError):
    """An answer longer than the client reads (max_answer_mb): not retried, the same request gets the same answer."""


async def read_capped(http: httpx.AsyncClient, request: httpx.Request, cap: int, url: str) -> httpx.Response:
    """Send `request`; its answer read whole (decoded) unless it declares or grows past `cap` bytes (AnswerTooLong,
    naming the server): httpx's own read would hold a body of any size, or a compressed one of any decoded size."""
    r = await http.send(request, stream=True)
    try:
        declared = r.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise AnswerTooLong(f"{url}: {request.method} {request.url.path}: the answer declares {int(declared)} "
                                f"bytes, more than the client reads ({cap}: max_answer_mb)", r.status_code)
        body = bytearray()
        async for chunk in r.aiter_bytes():
            body += chunk
            if len(body) > cap:
                raise AnswerTooLong(f"{url}: {request.method} {request.url.path}: the answer is longer than the "
                                    f"client reads ({cap} bytes: max_answer_mb)", r.status_code)
    finally:
        await r.aclose()
    # the bytes as read (decoded): the headers that described the encoded stream go
    headers = [(k, v) for k, v in r.headers.multi_items() if k.lower() not in ("content-encoding", "content-length")]
    return httpx.Response(r.status_code, headers=headers, content=bytes(body), request=request)


def exception_text(e: BaseException) -> str:
    """'TypeName: message', or the type name alone when the message is empty (httpx's ReadError often is)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class RetryingClient:
    """What both transports (this HTTP client, wamkit.serve.ws_client's websocket one) share: backoff between
    attempts, how long to keep retrying (`retries` attempts at least, and at least `retry_s` seconds since the first
    failure), and restarting their local server (`worker`) when it cannot be reached, one restart at a time."""

    url: str
    backoff: float
    backoff_max: float
    retries: int = 4
    retry_s: float = 0.0
    worker: Any = None
    _restart_lock: asyncio.Lock | None = None
    _warned_at: float = 0.0

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before attempt+1: the server's Retry-After (at most RETRY_AFTER_MAX_S, + jitter), else
        exponential backoff with jitter."""
        if retry_after is not None:
            return min(max(0.0, float(retry_after)), RETRY_AFTER_MAX_S) + random.uniform(0, 0.1)
        return min(self.backoff_max, self.backoff * (2 ** attempt)) * random.uniform(0.5, 1.5)

    def _retry_again(self, attempt: int, t_first: float, status: int | None) -> bool:
        """Whether a request that failed `attempt + 1` times, first at t_first (monotonic), the last time with
        `status` (None: no answer), is tried again."""
        if attempt < self.retries:
            return True
        return (status is None or status in UNAVAILABLE_STATUS) and time.monotonic() - t_first < self.retry_s

    async def _backoff(self, attempt: int, retry_after: float | None, why: str) -> None:
        """Wait before the next attempt; the first retry of an outage is logged (at most one line per 10 s)."""
        delay = self._delay(attempt, retry_after)
        now = time.monotonic()
        if attempt == 0 and now - self._warned_at > 10.0:
            self._warned_at = now
            log.warning("%s: %s; retrying (at least %d times%s)", self.url, why, self.retries,
                        f" and for {self.retry_s:g} s" if self.retry_s else "")
        await asyncio.sleep(delay)

    def _gave_up(self, what: str, attempt: int, t_first: float, last: str, status: int | None = None
                 ) -> ActionClientError:
        return ActionClientError(f"{self.url}: {what} failed after {attempt + 1} attempts over "
                                 f"{time.monotonic() - t_first:.1f} s: {last}", status)

    async def _maybe_restart_worker(self) -> None:
        """Restart the local server if it stopped answering; a replacement that listens elsewhere (a Ray actor
        re-created on another port or node) is followed: later attempts go to its url."""
        if self.worker is None:
            return
        if self._restart_lock is None:
            self._restart_lock = asyncio.Lock()
        async with self._restart_lock:
            await asyncio.to_thread(self.worker.ensure_healthy)
            url = getattr(self.worker, "url", None)
            if url and self._target(url) != self.url:
                log.warning("%s: the restarted server listens at %s; following it", self.url, url)
                await self._retarget(url)

    def _target(self, url: str) -> str:
        """The form of a server url this client keeps in self.url."""
        return url.rstrip("/")

    async def _retarget(self, url: str) -> None:
        """Send from now on to `url` (connections to the old address are dropped)."""
        raise NotImplementedError


def retry_after_s(header: str | None) -> float | None:
    """A Retry-After header in seconds (None when absent or not a number)."""
    try:
        return float(header) if header else None
    except ValueError:
        return None


class ActionClient(RetryingClient):
    def __init__(self, url: str, token: str | None = None, max_request_size: int | None = None, timeout_s: float = 120.0,
                 retries: int = 4, backoff: float = 0.25, backoff_max: float = 10.0, mode: str = "wamkit",
                 binary: bool = True, parameters: dict[str, Any] | None = None,
                 postprocess: Callable[[np.ndarray], np.ndarray] | None = None,
                 on_timing: Callable[[dict[str, Any]], None] | None = None, camera: str = DEFAULT_CAMERA,
                 raw_action_dim: int | None = None, max_connections: int = 64,
                 worker: Any = None, retry_s: float = 0.0, max_answer_mb: float = MAX_ANSWER_MB):
        if mode not in ("wamkit", "sglang"):
            raise ValueError(f"mode must be 'wamkit' or 'sglang', got {mode!r}")
        self.url = url.rstrip("/")
        self.token = token
        self._max_request = max_request_size
        self.timeout_s = float(timeout_s)
        self.max_answer_bytes = int(max_answer_mb * 1024 * 1024)
        self.retries, self.backoff, self.backoff_max = int(retries), float(backoff), float(backoff_max)
        self.retry_s = float(retry_s)
        self.mode, self.binary = mode, bool(binary)
        self.parameters = dict(parameters or {})
        self.postprocess, self.on_timing = postprocess, on_timing
        self.camera, self.raw_action_dim = camera, raw_action_dim
        self.worker = worker                       # optional ServerWorker: restarted when the server is unreachable
        self.last_timings: list[dict[str, Any]] = []
        self._metadata: dict[str, Any] | None = None
        self._native: bool | None = None           # the server is wamkit (its metadata says so): wamkit's forms
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http: httpx.AsyncClient | None = None
        self._old_http: list[httpx.AsyncClient] = []
        self._restart_lock: asyncio.Lock | None = None

    # ------------------------------------------------------------------ plumbing
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
            self._http = httpx.AsyncClient(base_url=self.url, headers=headers, limits=self._limits,
                                           timeout=httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s)))
        return self._http

    async def aclose(self) -> None:
        for h in [*self._old_http, self._http]:
            if h is not None:
                await h.aclose()
        self._http, self._old_http = None, []

    async def _retarget(self, url: str) -> None:
        self.url = self._target(url)
        if self._http is not None:   # requests in flight on it finish or fail (and retry); closed at aclose()
            self._old_http.append(self._http)
            self._http = None

    async def __aenter__(self) -> "ActionClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, content: bytes | None = None,
                       headers: dict[str, str] | None = None) -> tuple[httpx.Response, int]:
        """One HTTP exchange with retries. Returns (2xx response, attempts)."""
        last, status, attempt, t_first = "", None, 0, time.monotonic()
        while True:
            retry_after = None
            try:
                http = self._client()
                r = await read_capped(http, http.build_request(method, path, content=content, headers=headers),
                                      self.max_answer_bytes, self.url)
            except httpx.TransportError as e:
                last, status = exception_text(e), None
                await self._maybe_restart_worker()
            else:
                if r.is_success:
                    return r, attempt + 1
                status = r.status_code
                if status < 400:   # 3xx: the url given redirects
                    raise ActionClientError(f"{self.url}: {method} {path} answered {status} (redirect to "
                                            f"{r.headers.get('location', '?')}): give the server's own address, "
                                            f"not one that redirects", status, r.content)
                last = _error_message(r)
                if status not in RETRY_STATUS or _error_type(r) == POLICY_OUTPUT_ERROR:   # the same request fails
                    raise client_error(self.url, f"{method} {path} -> {status}: {last}", status, r.content)
                last = f"{status}: {last}"
                retry_after = r.headers.get("retry-after")
            if not self._retry_again(attempt, t_first, status):
                raise self._gave_up(f"{method} {path}", attempt, t_first, last, status)
            await self._backoff(attempt, retry_after_s(retry_after), last)
            attempt += 1

    # ------------------------------------------------------------------ API
    async def metadata(self, refresh: bool = False) -> dict[str, Any]:
        if self._metadata is None or refresh:
            r, _ = await self._request("GET", "/v1/actions/metadata")
            try:
                md = decode_body(r.content, r.headers.get("content-type"), lenient=True)
            except Exception as e:  # noqa: BLE001 - e.g. a proxy's HTML page at that path
                md = e
            if not isinstance(md, dict):
                what = exception_text(md) if isinstance(md, Exception) else f"a {type(md).__name__}"
                raise ActionClientError(f"{self.url}/v1/actions/metadata did not answer the action server's metadata "
                                        f"(a JSON object); got {what}: is server.url an action server?", r.status_code)
            self._metadata = md
        return self._metadata

    async def health(self) -> bool:
        try:
            r = await self._client().get("/health", timeout=5.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def max_request_size(self) -> int:
        if self._max_request:
            return int(self._max_request)
        try:
            md = await self.metadata()
            caps, output = _mapping(md, "capabilities"), _mapping(md, "output")
            self._max_request = _count(caps.get("max_batch_size") or 1, "capabilities.max_batch_size", self.url)
            if caps.get("batch_inputs") is False:      # SGLang's Cosmos3 metadata at --batching-max-size 1
                self._max_request = 1
            padded = output.get("padded_action_dim")
            padded = _count(padded, "output.padded_action_dim", self.url) if padded else None
            if self.raw_action_dim and padded and int(self.raw_action_dim) > padded:
                raise ActionClientError(f"{self.url}: raw_action_dim {self.raw_action_dim} > the model's "
                                        f"{padded} action channels (metadata output.padded_action_dim)")
        except ActionClientError as e:
            if e.status != 404:  # SGLang releases without the action metadata: one observation per request
                raise
            self._max_request = 1
        return self._max_request

    async def server_is_wamkit(self) -> bool:
        """Whether the server's metadata says it is `wamkit serve` (a server without the metadata route: no)."""
        if self._native is None:
            try:
                md = await self.metadata()
            except ActionClientError as e:
                if e.status != 404:
                    raise
                md = {}
            self._native = is_wamkit_server(md)
        return self._native

    async def _plan(self, observations: Sequence[Observation], seeds: Sequence[int]) -> list[list[int]]:
        """mode="wamkit" to a server that is not wamkit: SGLang's forms (plan_sglang_requests), else plan()."""
        limit = await self.max_request_size()
        if self.mode == "wamkit" and not await self.server_is_wamkit():
            return plan_sglang_requests(observations, seeds, limit)
        return self.plan(observations, seeds, limit)

    def _group_key(self, o: Observation, seed: int) -> tuple:
        if self.mode == "sglang":
            img = o.images.get(self.camera)
            return (o.task, None if img is None else tuple(img.shape), seed)
        cams = tuple(sorted((k, tuple(v.shape)) for k, v in o.images.items()))
        return (cams, None if o.state is None else int(o.state.shape[0]))

    def plan(self, observations: Sequence[Observation], seeds: Sequence[int], limit: int) -> list[list[int]]:
        """Indices of each request: groups of compatible observations, split to at most `limit`."""
        groups: dict[tuple, list[int]] = {}
        for i, (o, s) in enumerate(zip(observations, seeds)):
            groups.setdefault(self._group_key(o, int(s)), []).append(i)
        out = []
        for idx in groups.values():
            out += [idx[k:k + limit] for k in range(0, len(idx), limit)]
        return out

    async def predict(self, observations: Sequence[Observation], seeds: Sequence[int] | None = None,
                      parameters: dict[str, Any] | None = None) -> np.ndarray:
        """(N, H, D) float32 action chunks for N observations, in order."""
        n = len(observations)
        seeds = checked_seeds(n, seeds)
        params = {**self.parameters, **(parameters or {})}
        rad = params.get("raw_action_dim", self.raw_action_dim)
        if self.mode == "sglang":
            params = sglang_parameters(**params)
        plan = await self._plan(observations, seeds)
        timings: list[dict[str, Any]] = []
        results = await asyncio.gather(*(self._send([observations[i] for i in idx], [seeds[i] for i in idx],
                                                    params, rad, timings) for idx in plan))
        out = scatter_chunks(n, plan, results)
        timings.sort(key=lambda t: t["t_send"])
        self.last_timings = timings
        if self.postprocess is not None:
            out = np.asarray(self.postprocess(out), np.float32)
        return out

    async def _send(self, obs: list[Observation], seeds: list[int], params: dict[str, Any], rad: int | None,
                    timings: list[dict[str, Any]]) -> np.ndarray:
        if self.mode == "sglang":
            body = build_sglang_request(obs, seeds[0], params, camera=self.camera, binary=self.binary)
            try:
                check_sglang_request(body, self._max_request)
            except ValueError as e:
                raise ActionClientError(f"{self.url}: not sent (SGLang would refuse it): {e}") from None
        elif self._native:
            body = build_request(obs, seeds, params, binary=self.binary)
        else:   # a server that is not wamkit: one seed a request, SGLang's image forms (plan_sglang_requests)
            body = build_sglang_observation_request(obs, seeds[0], params, "ndarray" if self.binary else "png")
        data, ctype = encode_body(body, self.binary)
        headers = {"content-type": ctype, "accept": MSGPACK if self.binary else "application/json"}
        t_send = time.time()
        r, attempts = await self._request("POST", "/v1/actions/generations", content=data, headers=headers)
        t_recv = time.time()
        try:
            resp = parse_response(decode_body(r.content, r.headers.get("content-type"), lenient=True),
                                  raw_action_dim=rad, expect_n=len(obs))
        except ProtocolError as e:
            raise ActionClientError(f"{self.url}: bad response: {e}", r.status_code) from None
        rec = {"request_id": body["request_id"], "n": len(obs), "t_send": t_send, "t_recv": t_recv,
               "client_ms": round((t_recv - t_send) * 1000.0, 3), "attempts": attempts,
               "request_bytes": len(data), "response_bytes": len(r.content), "server": resp.timing}
        timings.append(rec)
        if self.on_timing is not None:
            self.on_timing(rec)
        return resp.actions


def checked_seeds(n: int, seeds: Sequence[int] | None) -> list[int]:
    """One integer seed per observation (0..n-1 when none are given)."""
    if n == 0:
        raise ValueError("predict needs at least one observation")
    seeds = list(range(n)) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} observations")
    return seeds


def scatter_chunks(n: int, plan: list[list[int]], results: Sequence[np.ndarray]) -> np.ndarray:
    """The chunks of each request (`plan[k]`: the observation indices of request k) back in observation order."""
    out: np.ndarray | None = None
    for idx, acts in zip(plan, results):
        if out is None:
            out = np.empty((n,) + acts.shape[1:], np.float32)
        elif acts.shape[1:] != out.shape[1:]:
            raise ActionClientError(f"requests returned chunks of shapes {acts.shape[1:]} and {out.shape[1:]}")
        out[idx] = acts
    return out


def _mapping(md: dict[str, Any], key: str) -> dict[str, Any]:
    v = md.get(key) or {}
    return v if isinstance(v, dict) else {}


def _count(value: Any, field: str, url: str) -> int:
    """A positive integer from the server's metadata, or one line naming the field."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or isinstance(value, bool):
        raise ActionClientError(f"{url}/v1/actions/metadata: {field} must be a positive integer, got {value!r}")
    return n


def _error_type(r: httpx.Response) -> str | None:
    """The error layout's `error.type` of an answer, if it has one."""
    try:
        e = r.json().get("error")
        return str(e.get("type")) if isinstance(e, dict) else None
    except (ValueError, AttributeError):
        return None


def _error_message(r: httpx.Response) -> str:
    try:
        j = r.json()
        if isinstance(j, dict):
            e = j.get("error")
            if isinstance(e, dict) and e.get("message"):
                return str(e["message"])
            if j.get("detail"):
                return str(j["detail"])
    except ValueError:
        pass
    return r.text[:500]


class SyncActionClient(ClosingContext):
    """Blocking twin of ActionClient: owns an event loop in a background thread (keeps the connection pool)."""

    def __init__(self, url: str, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wamkit-client", daemon=True)
        self._thread.start()
        self.client = ActionClient(url, **kwargs)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int] | None = None,
                parameters: dict[str, Any] | None = None) -> np.ndarray:
        return self._run(self.client.predict(observations, seeds, parameters))

    def metadata(self) -> dict[str, Any]:
        return self._run(self.client.metadata())

    @property
    def last_timings(self) -> list[dict[str, Any]]:
        return self.client.last_timings

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self.client.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()
