"""Async action client for a wamkit or SGLang action server.

    async with ActionClient(url) as c:
        actions = await c.predict(observations, seeds)          # float32 (N, H, D), in observation order

What it does per predict():
1. groups observations that may share a server batch (wamkit: same cameras/shapes/state length; sglang: same prompt
   text and image shape, optionally same seed), splits groups into requests of at most `max_request_size` (default: the
   server's metadata `capabilities.max_batch_size`);
2. sends all requests concurrently over one pooled httpx.AsyncClient (msgpack + raw uint8 arrays by default);
3. retries connection errors, 5xx and 429 with exponential backoff + jitter, honouring Retry-After; 4xx raise at once
   (ActionClientError with the server's message naming the field);
4. sorts each response by input_index, keeps the first raw_action_dim channels, scatters chunks back into order, then
   applies `postprocess` (e.g. a denormalizer) to the (N, H, D) array.
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
import random
import threading
import time
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from wamkit.core.lifecycle import ClosingContext
from wamkit.core.types import Observation
from wamkit.protocol import (MSGPACK, ProtocolError, build_request, build_sglang_request, check_sglang_request,
                             decode_body, encode_body, parse_response, sglang_parameters)
from wamkit.protocol.messages import DEFAULT_CAMERA

RETRY_STATUS = frozenset((429, 500, 502, 503, 504))


class ActionClientError(RuntimeError):
    """The server refused a request (4xx) or retries ran out. status: HTTP status (None: connection failure)."""

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status, self.body = status, body


class RetryingClient:
    """What both transports (this HTTP client, wamkit.serve.ws_client's websocket one) share: backoff between
    attempts and restarting their local server (`worker`) when it cannot be reached, one restart at a time."""

    backoff: float
    backoff_max: float
    worker: Any = None
    _restart_lock: asyncio.Lock | None = None

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before attempt+1: the server's Retry-After (+ jitter), else exponential backoff with jitter."""
        if retry_after is not None:
            return max(0.0, float(retry_after)) + random.uniform(0, 0.1)
        return min(self.backoff_max, self.backoff * (2 ** attempt)) * random.uniform(0.5, 1.5)

    async def _maybe_restart_worker(self) -> None:
        if self.worker is None:
            return
        if self._restart_lock is None:
            self._restart_lock = asyncio.Lock()
        async with self._restart_lock:
            await asyncio.to_thread(self.worker.ensure_healthy)


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
                 worker: Any = None):
        if mode not in ("wamkit", "sglang"):
            raise ValueError(f"mode must be 'wamkit' or 'sglang', got {mode!r}")
        self.url = url.rstrip("/")
        self.token = token
        self._max_request = max_request_size
        self.timeout_s = float(timeout_s)
        self.retries, self.backoff, self.backoff_max = int(retries), float(backoff), float(backoff_max)
        self.mode, self.binary = mode, bool(binary)
        self.parameters = dict(parameters or {})
        self.postprocess, self.on_timing = postprocess, on_timing
        self.camera, self.raw_action_dim = camera, raw_action_dim
        self.worker = worker                       # optional ServerWorker: restarted when the server is unreachable
        self.last_timings: list[dict[str, Any]] = []
        self._metadata: dict[str, Any] | None = None
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http: httpx.AsyncClient | None = None
        self._restart_lock: asyncio.Lock | None = None

    # ------------------------------------------------------------------ plumbing
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
            self._http = httpx.AsyncClient(base_url=self.url, headers=headers, limits=self._limits,
                                           timeout=httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s)))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> "ActionClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, content: bytes | None = None,
                       headers: dict[str, str] | None = None) -> tuple[httpx.Response, int]:
        """One HTTP exchange with retries. Returns (response with status < 400, attempts)."""
        last: str = ""
        for attempt in range(self.retries + 1):
            retry_after = None
            try:
                r = await self._client().request(method, path, content=content, headers=headers)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
                status = None
                await self._maybe_restart_worker()
            else:
                if r.status_code < 400:
                    return r, attempt + 1
                status = r.status_code
                last = _error_message(r)
                if status not in RETRY_STATUS:
                    raise ActionClientError(f"{method} {path} -> {status}: {last}", status, r.content)
                retry_after = r.headers.get("retry-after")
            if attempt < self.retries:
                await asyncio.sleep(self._delay(attempt, retry_after_s(retry_after)))
        raise ActionClientError(f"{method} {path} failed after {self.retries + 1} attempts: {last}", status)

    # ------------------------------------------------------------------ API
    async def metadata(self, refresh: bool = False) -> dict[str, Any]:
        if self._metadata is None or refresh:
            r, _ = await self._request("GET", "/v1/actions/metadata")
            self._metadata = r.json()
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
            caps = md.get("capabilities") or {}
            self._max_request = int(caps.get("max_batch_size") or 1)
            if caps.get("batch_inputs") is False:      # SGLang's Cosmos3 metadata at --batching-max-size 1
                self._max_request = 1
            padded = (md.get("output") or {}).get("padded_action_dim")
            if self.raw_action_dim and padded and int(self.raw_action_dim) > int(padded):
                raise ActionClientError(f"{self.url}: raw_action_dim {self.raw_action_dim} > the model's "
                                        f"{padded} action channels (metadata output.padded_action_dim)")
        except ActionClientError as e:
            if e.status != 404:  # SGLang releases without the action metadata: one observation per request
                raise
            self._max_request = 1
        return self._max_request

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
        plan = self.plan(observations, seeds, await self.max_request_size())
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
                raise ActionClientError(f"not sent to {self.url} (SGLang would refuse it): {e}") from None
        else:
            body = build_request(obs, seeds, params, binary=self.binary)
        data, ctype = encode_body(body, self.binary)
        headers = {"content-type": ctype, "accept": MSGPACK if self.binary else "application/json"}
        t_send = time.time()
        r, attempts = await self._request("POST", "/v1/actions/generations", content=data, headers=headers)
        t_recv = time.time()
        try:
            resp = parse_response(decode_body(r.content, r.headers.get("content-type")), raw_action_dim=rad,
                                  expect_n=len(obs))
        except ProtocolError as e:
            raise ActionClientError(f"bad response from {self.url}: {e}", r.status_code) from None
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
