"""Where action chunks come from during an evaluation: the policy in this process, or an action server over HTTP.

Both are asynchronous: `await predict(observations, seeds)` never blocks the scheduler's event loop, and several
calls may be in flight. Every call records a span on the timeline (request in flight; server computing). Every
answer is held to the rules of wamkit.policies.checks (shape, dtype, finite; a chunk longer than the horizon cut to
it, a shorter one refused): the same rules `wamkit serve` applies to what its policy returns, so an evaluation runs
the same actions whatever `inference=` says."""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

import numpy as np

from wamkit.core.cpu_pinning import split_cpus
from wamkit.core.errors import RunError, UserError
from wamkit.core.secrets import redact
from wamkit.core.types import Observation
from wamkit.eval.timeline import Timeline
from wamkit.policies.base import RemoteCodec
from wamkit.policies.checks import PolicyOutputError, check_chunks, env_problem, policy_label, read_only
from wamkit.protocol.messages import observation_key
from wamkit.serve.config import TOKEN_ENV

log = logging.getLogger(__name__)

__all__ = ["Inference", "InProcessInference", "ServerInference", "PolicyOutputError", "PolicyFailed",
           "check_actions"]


def _same_served(a: dict, b: dict) -> bool:
    """Two servers' (or a server's and a resumed run's) served policies agree: the same name, and the same export
    directory where both say which (a server that does not say, an older one, is not held against the other). The
    directory is compared by its own name: servers report it relative to their working directory (never absolute,
    since session 33), and a run recorded before that holds the absolute path."""
    paths = (a.get("model_path"), b.get("model_path"))
    if None in paths:
        return a.get("name") == b.get("name")
    return a.get("name") == b.get("name") and PurePosixPath(paths[0]).name == PurePosixPath(paths[1]).name


class PolicyFailed(RunError):
    """The policy raised in predict (in this process): one line naming it, the episode(s) and the resume hint."""


KEPT_LATENCIES = 200   # Inference.latencies: the most recent calls kept (the planner reads the last 100 at most)


class Inference(abc.ABC):
    max_request_size: int = 64   # the most observations one predict() may carry (the server's max batch size)
    name: str = ""
    # whether requests in flight together are merged into one model batch (an action server's dynamic batching);
    # False: each predict() is its own model call, one after another (auto then never sends every observation at
    # once: eval/shape_probe.py)
    merges_requests: bool = False

    def __init__(self, timeline: Timeline | None = None):
        self.timeline = timeline
        self.action_dim: int | None = None   # the envs' (set by the runner): each chunk's last axis is checked against it
        self.horizon: int | None = None      # the chunk length asked for (`horizon=`), None: the policy's own
        self.observations = 0
        self.requests = 0
        self.latencies: deque[tuple[int, float]] = deque(maxlen=KEPT_LATENCIES)   # (batch size, seconds), latest
        self._plan: tuple[list, int, int] | None = None   # (episodes, seed, max steps): naming episodes in errors

    def prepare(self, env_spec, horizon: int | None = None, episodes: Sequence = (), seed: int = 0) -> None:
        """What the run knows before any episode (the runner calls it once the envs are up): the envs' spec (action
        dim, cameras, state), the horizon asked for, and the episodes to run with the run's seed (an error names the
        episode an observation belongs to: policy seeds are a function of (episode, env step), eval/plan.py)."""
        self.action_dim = int(env_spec.action_dim)
        self.horizon = None if horizon is None else int(horizon)
        self._plan = (list(episodes), int(seed), int(getattr(env_spec, "max_steps", 0) or 0))

    def episodes_of(self, seeds: Sequence[int]) -> str:
        """'episode mt/0/1 (env step 8)' (or several) for the observations of `seeds`; '' where it cannot be told."""
        if not self._plan or not self._plan[0]:
            return ""
        from wamkit.eval.plan import step_seed

        episodes, base, max_steps = self._plan
        want = {int(s) for s in seeds}
        found: dict[int, str] = {}
        for step in range(max_steps + 1):            # step 0 first: most failures happen on an episode's first call
            for ep in episodes:
                s = step_seed(base, ep, step)
                if s in want and s not in found:
                    found[s] = f"{ep.key} (env step {step})"
            if len(found) == len(want):
                break
        names = [found[int(s)] for s in seeds if int(s) in found]
        if not names:
            return ""
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"episode{'s' if len(names) > 1 else ''} {shown}"

    async def start(self) -> None:  # noqa: B027
        pass

    async def close(self) -> None:  # noqa: B027
        pass

    @abc.abstractmethod
    async def _predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        ...

    def _horizon_rule(self) -> tuple[int | None, str]:
        """(the chunk length every answer is cut to or refused below, how the message names it); None: not checked
        here (the server path holds its answers to `horizon=` itself)."""
        return None, ""

    async def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        t0 = time.time()
        horizon, horizon_name = self._horizon_rule()
        out = check_actions(await self._predict(observations, seeds), len(observations), self.action_dim,
                            self.describe(), horizon=horizon, horizon_name=horizon_name)
        t1 = time.time()
        self.observations += len(observations)
        self.requests += 1
        self.latencies.append((len(observations), t1 - t0))
        if self.timeline is not None:
            self.timeline.add("request", "request", t0, t1, len(observations))
        return out

    def waiting_text(self) -> str:
        """A note for the progress line while the policy has been computing for long ('' otherwise)."""
        return ""

    def describe(self) -> str:
        """Who answered, for an error message."""
        return f"the policy ({self.name or type(self).__name__})"


def check_actions(out, n: int, action_dim: int | None, who: str, horizon: int | None = None,
                  horizon_name: str = "") -> np.ndarray:
    """(n, H, action_dim) finite float32 actions, or PolicyOutputError (wamkit.policies.checks.check_chunks, the rule
    `wamkit serve` applies too): NaN went into the simulator (MuJoCo warned and the episode counted as an ordinary
    failure: a broken model looked like a 0% success rate), inf was clipped without a word, a wrong shape failed later
    in an env worker with a long traceback, a short batch as an IndexError in the scheduler. With `horizon`, a longer
    chunk is cut to it and a shorter one refused."""
    return check_chunks(out, n, action_dim=action_dim, horizon=horizon, who=who, need="the envs need",
                        horizon_name=horizon_name)


class _DaemonExecutor(concurrent.futures.Executor):
    """One daemon thread that runs the submitted calls in order. A ThreadPoolExecutor's worker is joined when the
    interpreter exits, so a predict still running when Ctrl-C or SIGTERM stopped the run held the process until it
    returned (5 minutes for a probe's slow policy); this thread is not waited for."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._shutdown = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        f: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((f, fn, args, kwargs))
        return f

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            f, fn, args, kwargs = item
            if not f.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                f.set_exception(e)
            else:
                f.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        if cancel_futures:
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self._q.get_nowait()
                    if item is not None:
                        item[0].cancel()
        self._q.put(None)
        if wait:
            self._thread.join()


WAIT_NOTE_S = 10.0       # a predict running longer than this is named on the progress line
WAIT_WARN_S = 30.0       # ... and logged (again at 2x, 4x ... this)


class InProcessInference(Inference):
    """The policy in this process, on one worker thread (the event loop keeps scheduling envs meanwhile).

    batching=(max_batch_size, max_wait_ms) (`inprocess_batching=true`): requests in flight together are merged into
    one policy call by wamkit serve's own DynamicBatcher (idle dispatch: a lone request goes at once; those that come
    while a batch computes leave together after it), with no transport at all; auto then measures the shapes that rely
    on merging (merges_requests). None: each request is its own call, one after another.

    What the policy gets and returns is checked as `wamkit serve` checks it: the env's cameras and state against
    policy.spec before any episode (prepare), read-only observation arrays, and every answer by check_actions with
    the horizon asked for (else spec.action.horizon). An exception in predict stops the run with one line naming the
    policy and the episode(s); Ctrl-C / SIGTERM do not wait for a predict that is still running; close() closes the
    policy."""

    name = "inprocess"

    def describe(self) -> str:
        return policy_label(self.policy)

    def __init__(self, policy, timeline: Timeline | None = None, batching: tuple[int, float] | None = None):
        super().__init__(timeline)
        self.policy = policy
        self.max_request_size = int(policy.max_batch_size())
        policy.warmup(self.max_request_size)  # one-off work (e.g. CUDA graphs of every batch size) before any timing
        # one worker thread (a daemon: an interrupted run does not wait for it), also the batcher's (batching)
        self._pool = _DaemonExecutor("policy")
        self._batching = batching
        self._batcher = None
        self.merges_requests = batching is not None
        self._busy_since: float | None = None    # monotonic start of the predict computing now
        self._watch: asyncio.Task | None = None
        self._closed = False

    @property
    def spec(self):
        return getattr(self.policy, "spec", None)

    def prepare(self, env_spec, horizon: int | None = None, episodes: Sequence = (), seed: int = 0) -> None:
        """Also: what the policy reads is checked against the env (cameras, state length), and a horizon longer than
        the policy's chunks, before any episode runs: one line (the server answers such requests 422)."""
        super().prepare(env_spec, horizon, episodes, seed)
        spec = self.spec
        if spec is None:
            return
        problem = env_problem(spec, tuple(getattr(env_spec, "cameras", ()) or ()),
                              int(getattr(env_spec, "state_dim", 0) or 0))
        if problem:
            raise UserError(problem)
        if self.horizon is not None and self.horizon > spec.action.horizon:
            raise UserError(f"horizon={self.horizon} asks {policy_label(self.policy)} for chunks of {self.horizon} "
                            f"actions; it predicts {spec.action.horizon} (spec.action.horizon)")

    def _horizon_rule(self) -> tuple[int | None, str]:
        spec = self.spec
        own = spec.action.horizon if spec is not None else None
        if self.horizon is not None and self.horizon != own:
            return self.horizon, f"horizon={self.horizon} asks for {self.horizon}"
        return own, ""

    def _run(self, observations, seeds):
        t0 = time.time()
        self._busy_since = time.monotonic()
        try:
            out = self.policy.predict(read_only(observations), list(seeds))
        finally:
            self._busy_since = None
        if self.timeline is not None:
            self.timeline.add("server", "compute", t0, time.time(), len(observations))
        return out

    async def start(self) -> None:
        if self._batching is not None and self._batcher is None:
            from wamkit.serve.batcher import DynamicBatcher

            max_batch, wait_ms = self._batching
            self._batcher = DynamicBatcher(self._run, min(int(max_batch), self.max_request_size), wait_ms,
                                           max_queue=1 << 30, idle_dispatch=True, executor=self._pool,
                                           check_output=False)   # Inference.predict checks every answer
            await self._batcher.start()
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_predict())

    async def _predict(self, observations, seeds):
        try:
            if self._batcher is not None:
                actions, _ = await self._batcher.submit(observations, seeds,
                                                        [observation_key(o) for o in observations])
                return actions
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self._run, observations, seeds)
        except (PolicyOutputError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - the policy's own error: one line naming it and the episode(s)
            raise self._failure(e, seeds) from None

    def _failure(self, e: Exception, seeds: Sequence[int]) -> Exception:
        where = self.episodes_of(seeds)
        tb, at = e.__traceback__, ""
        while tb is not None:
            at = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
            tb = tb.tb_next
        msg = (str(e).splitlines() or [""])[0]
        what = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
        refused = isinstance(e, UserError)
        text = (f"{policy_label(self.policy)} {'refused its input' if refused else 'failed in predict'} "
                f"({what}{at}){' on ' + where if where else ''}; the episodes already recorded are kept: fix it, "
                f"then run the same command with resume=true")
        return UserError(text) if refused else PolicyFailed(text)

    def waiting_text(self) -> str:
        since = self._busy_since
        if since is None:
            return ""
        s = time.monotonic() - since
        return f"waiting on {policy_label(self.policy)}: predict running for {s:.0f} s" if s >= WAIT_NOTE_S else ""

    async def _watch_predict(self) -> None:
        """Log a line when one predict runs for long (the progress bar alone looked stuck: '0/1 envs busy')."""
        warned_at = 0.0
        while True:
            await asyncio.sleep(1.0)
            since = self._busy_since
            if since is None:
                warned_at = 0.0
                continue
            s = time.monotonic() - since
            if s >= max(WAIT_WARN_S, 2 * warned_at):
                warned_at = s
                log.warning("%s (Ctrl-C stops the run without waiting for it; resume=true continues it)",
                            self.waiting_text())

    async def close(self) -> None:
        """Stop the batcher and the worker thread without waiting for a predict still running (an interrupted run
        exits at once; the thread ends with the process), then close the policy if none is."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        busy = self._busy_since is not None
        if self._batcher is not None:
            if busy:
                self._batcher.abort()
            else:
                await self._batcher.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if busy or self._closed:   # closing a policy under a running predict is not safe: the process exit ends it
            return
        self._closed = True
        try:
            self.policy.close()
        except Exception as e:  # noqa: BLE001 - the results are written; say it and go on
            log.warning("%s: close() failed: %s: %s", policy_label(self.policy), type(e).__name__, e)


DEFAULT_REQUEST_TIMEOUT_S = 120.0   # server.request_timeout_s when neither it nor the policy names one
SERVED_FILE = "served_policy.json"   # in out=: the policy the server(s) at server.url served (ServerInference)


def _journal_has_records(out: Path) -> bool:
    try:
        with open(out / "results.jsonl", "rb") as f:
            return any(line.strip() for line in f)
    except OSError:
        return False


class ServerInference(Inference):
    """Action server(s) over HTTP or websockets (`server.protocol`; auto: SGLang's realtime websocket to the `wamkit
    serve` processes started here, HTTP to server.url): local servers started here (`server.launch`: `wamkit serve`
    processes, or `sglang serve` for models SGLang serves; `server.replicas`, e.g. one per GPU with `server.gpus`;
    each restarted by its client when it stops answering, the request then retried), or existing URLs (`server.url=`,
    comma-separated; wamkit serve or SGLang). With several servers each request goes to the one with the fewest
    observations in flight.

    A policy with a RemoteCodec (cosmos3: the model runs in SGLang) keeps its pre- and post-processing here, in the
    evaluation process: observations are encoded off the event loop, sent with the codec's parameters and seeds in
    SGLang's request form, and the answers decoded to env actions, so several requests are in flight at once."""

    name = "server"
    merges_requests = True    # wamkit serve's DynamicBatcher; SGLang under --batching-mode dynamic

    def describe(self) -> str:
        return f"the action server's policy ({self.policy_name})"

    def __init__(self, *, policy: str, policy_args: dict, options, timeline: Timeline | None = None,
                 worker_factory=None, workers: Sequence | None = None, codec: RemoteCodec | None = None,
                 log_dir: str | Path | None = None, horizon: int | None = None):
        super().__init__(timeline)
        self.policy_name, self.policy_args, self.options = policy, dict(policy_args), options
        # the chunk length asked of the server (action_horizon) and cut to: eval's horizon=, which an export does
        # not take as an argument (runner.policy_kwargs), else the policy's horizon argument
        self.chunk_horizon = horizon or self.policy_args.get("horizon")
        self.codec = codec
        self.worker_factory = worker_factory     # None: a local `wamkit serve` (or `sglang serve`) subprocess
        self.log_dir = log_dir                   # the servers we start log to LOG_DIR/server-<i>.log (None: a tempfile)
        # workers: servers started by the caller (e.g. one set for every row of `bench eval`): used instead of
        # starting our own, restarted when they stop answering, left running at close
        self.attached = list(workers or [])
        self.workers: list = []
        self._starts0: list[int] = []
        # requests answered only after a retry (a dropped connection, a 503...): each cost a backoff and a resend
        self.request_retries = 0
        self.clients: list = []
        self.in_flight: list[int] = []           # observations in flight per server
        self.served: list[int] = []              # requests answered per server
        self._next = 0
        # what the server(s) at server.url serve, from their metadata (None: servers started here run self.policy)
        self.served_policy: dict[str, Any] | None = None
        self.protocol = resolve_protocol(options, codec)
        check_normalization(options, codec)

    @property
    def worker(self):
        """The first local server (None when serving from URLs)."""
        return self.workers[0] if self.workers else None

    @property
    def client(self):
        return self.clients[0] if self.clients else None

    @property
    def restarts(self) -> int:
        """Server restarts during this run."""
        return sum(max(0, w.starts - max(s0, 1)) for w, s0 in zip(self.workers, self._starts0))

    async def start(self) -> None:
        from wamkit.serve.http import tune_malloc

        tune_malloc()   # this process encodes every request body: large buffers from the heap, not fresh mmaps
        if self.attached:
            self.workers = self.attached
            await asyncio.gather(*(asyncio.to_thread(w.wait_healthy, self.options.startup_timeout_s)
                                   for w in self.workers))
            targets = [(w.url, w) for w in self.workers]
        elif self.options.url is None:
            policy, args = server_policy(self.policy_name, self.policy_args, self.options, self.codec)
            self.workers = await asyncio.to_thread(start_server_workers, policy, args, self.options,
                                                   self.worker_factory, log_dir=self.log_dir)
            targets = [(w.url, w) for w in self.workers]
        else:
            targets = [(u.strip(), None) for u in str(self.options.url).split(",") if u.strip()]
        self._starts0 = [w.starts for w in self.workers]
        self.clients = [self._make_client(url, w) for url, w in targets]
        self.in_flight = [0] * len(self.clients)
        self.served = [0] * len(self.clients)
        self.max_request_size = min([await c.max_request_size() for c in self.clients])
        if self.options.url is not None and not self.attached:
            await self._record_served(targets)

    async def _record_served(self, targets) -> None:
        """The policy the server(s) at server.url serve (their metadata: policy_family / model / model_path), for the
        summary and the report (the run's `policy` key names nothing there), and held to on a resume: OUT/
        served_policy.json keeps it, and a resume against a server that serves another policy is one line."""
        served = []
        for (url, _), c in zip(targets, self.clients):
            try:
                md = await c.metadata()
            except Exception:  # noqa: BLE001 - a server without metadata (it answered max_request_size without)
                md = {}
            md = md if isinstance(md, dict) else {}
            spec = md.get("policy") if isinstance(md.get("policy"), dict) else {}
            name = md.get("policy_family") or spec.get("name") or md.get("model")
            # recorded (served_policy.json, summary, config.json, report): no URL userinfo, nothing secret
            served.append(redact({"policy": md.get("model_path") or name, "name": name, "model": md.get("model"),
                                  "model_path": md.get("model_path"), "url": url}))
        if any(not _same_served(s, served[0]) for s in served[1:]):
            raise UserError("server.url lists servers that serve different policies: "
                            + ", ".join(f"{s['url']}: {s['policy']}" for s in served))
        self.served_policy = served[0] if len(served) == 1 else {**served[0], "url": [s["url"] for s in served]}
        if self.log_dir is None:
            return
        from wamkit.core.files import write_atomic

        out = Path(self.log_dir)
        path = out / SERVED_FILE
        try:
            old = json.loads(path.read_text()) if path.exists() and _journal_has_records(out) else None
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and not _same_served(old, self.served_policy):
            raise UserError(f"resume=true but {out} was evaluated against a server serving {old.get('policy')!r}; "
                            f"server.url now serves {self.served_policy['policy']!r}: evaluate into a new out=")
        write_atomic(path, json.dumps(self.served_policy, indent=2))
        cfg_path = out / "config.json"      # the run's config, with what the server served
        with contextlib.suppress(OSError, ValueError):
            cfg = json.loads(cfg_path.read_text())
            if isinstance(cfg, dict):
                write_atomic(cfg_path, json.dumps({**cfg, "served_policy": self.served_policy}, indent=2))

    def _make_client(self, url: str, worker):
        """The transport to one server, by `server.protocol`: an object with the async ActionClient interface
        (predict(observations, seeds) -> (N, H, D) float32, max_request_size(), aclose())."""
        from wamkit.protocol.client import ActionClient

        o, own = self.options, (self.codec.transport if self.codec is not None else {})
        # the policy's own transport options (cosmos3's token, timeout_s, max_request_size) where server.* names none
        timeout = o.request_timeout_s or own.get("timeout_s") or DEFAULT_REQUEST_TIMEOUT_S
        kw = dict(token=client_token(o, worker, own.get("token")), on_timing=self._on_timing, worker=worker,
                  timeout_s=timeout, retries=o.retries, retry_s=o.retry_s,
                  max_request_size=own.get("max_request_size") or None)
        if self.protocol == "wamkit":
            horizon = self.chunk_horizon
            return ActionClient(url, parameters={"action_horizon": int(horizon)} if horizon else None, **kw)
        if self.protocol == "sglang":
            if self.codec is not None:
                return ActionClient(url, mode="sglang", camera=self.codec.camera, parameters=self.codec.parameters(),
                                    raw_action_dim=self.codec.raw_action_dim, **kw)
            return ActionClient(url, mode="sglang", **kw)
        if self.protocol in ("openpi", "sglang-ws"):  # websocket: openpi's policy protocol / SGLang's realtime route
            from wamkit.serve.ws_client import WebsocketActionClient

            # arrays through shared memory to a server started on this host (used when its metadata offers it)
            shm = bool(getattr(self.options, "shm_arrays", False)) and worker is not None
            return WebsocketActionClient(url, protocol=self.protocol, action_horizon=self.chunk_horizon,
                                         shm_arrays=shm, **kw)
        raise UserError(f"server.protocol={self.protocol!r} is not supported; valid choices: wamkit, sglang, openpi, "
                        f"sglang-ws")

    def _on_timing(self, rec: dict) -> None:
        self.request_retries += max(0, int(rec.get("attempts", 1)) - 1)
        t = rec.get("server") or {}
        if self.timeline is not None and "t_start" in t:
            self.timeline.add("server", "compute", float(t["t_start"]), float(t["t_end"]),
                              int(t.get("batch_size", rec.get("n", 1))))

    async def _predict(self, observations, seeds):
        k = len(self.clients)
        order = [(self._next + j) % k for j in range(k)]      # ties: round robin
        i = min(order, key=lambda j: self.in_flight[j])
        self._next = (i + 1) % k
        n = len(observations)
        self.in_flight[i] += n
        try:
            if self.codec is None:
                out = await self.clients[i].predict(list(observations), list(seeds))
            else:   # pre/post-processing (image layout, prompt, denormalization...) off the event loop
                sent = await asyncio.to_thread(self.codec.encode, list(observations))
                values = await self.clients[i].predict(sent, self.codec.seeds(seeds))
                out = await asyncio.to_thread(self.codec.decode, values)
        finally:
            self.in_flight[i] -= n
        self.served[i] += 1
        return self._at_horizon(out)

    def _at_horizon(self, out: np.ndarray) -> np.ndarray:
        """With a horizon asked for (`horizon=`, sent to the server as action_horizon), a longer chunk is cut to it
        and a shorter one refused: a server that ignores the parameter must not change how many steps each chunk
        runs (a 9-step chunk would be executed whole)."""
        h = self.chunk_horizon
        a = np.asarray(out)
        if not h or a.ndim != 3:
            return out
        if a.shape[1] < int(h):
            raise PolicyOutputError(f"{self.describe()} returned chunks of {a.shape[1]} actions; horizon={h} asks "
                                    f"for {h}")
        return a[:, : int(h)]

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in self.workers if w not in self.attached))


# what server.protocol=auto speaks to the `wamkit serve` processes an evaluation starts itself: SGLang's realtime
# websocket route, one frame per request with all its observations (one batch on the server), ~40-70% less per-request
# overhead than HTTP + msgpack for MetaWorld-shaped requests of 1-16 observations (bench/results/request_overhead.md)
LOCAL_SERVE_PROTOCOL = "sglang-ws"


def _websockets_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("websockets") is not None


def resolve_protocol(options, codec: RemoteCodec | None) -> str:
    """`server.protocol`, with auto resolved: the codec's wire form for a policy served elsewhere; for the `wamkit
    serve` processes started here (launch=wamkit, no url) LOCAL_SERVE_PROTOCOL; else wamkit (HTTP)."""
    protocol = getattr(options, "protocol", "auto") or "auto"
    if protocol == "auto":
        if codec is not None:
            return codec.protocol
        local = getattr(options, "url", None) is None and getattr(options, "launch", "wamkit") == "wamkit"
        # the websocket client needs `websockets` (a dependency of wamkit; a hand-assembled environment, such as a
        # GPU machine's carried wheels, may lack it): without it auto stays on HTTP rather than failing
        return LOCAL_SERVE_PROTOCOL if local and _websockets_available() else "wamkit"
    if codec is not None and protocol != codec.protocol:
        raise UserError(f"server.protocol={protocol}, but this policy is served in {codec.protocol}'s request form "
                        f"(its model runs in {codec.protocol}): use server.protocol={codec.protocol} or auto")
    return protocol


def check_normalization(options, codec: RemoteCodec | None) -> None:
    """An SGLang server started with action stats denormalizes itself and its answers do not say so: the adapter
    must agree (normalization=server), else the actions would be denormalized twice (or not at all)."""
    if codec is None or options.url is not None or getattr(options, "launch", "wamkit") != "sglang":
        return
    stats = (getattr(options, "sglang", None) or {}).get("action_stats_path")
    if stats and not codec.server_normalizes:
        raise UserError("server.sglang.action_stats_path makes SGLang denormalize the actions, and this policy "
                        "denormalizes them too: set policy_args.normalization=server (and drop policy_args."
                        "action_stats), or drop server.sglang.action_stats_path")
    if codec.server_normalizes and not stats:
        raise UserError("policy_args.normalization=server, but the SGLang server started here gets no action stats: "
                        "set server.sglang.action_stats_path (or normalization=client with action_stats)")


def server_policy(policy: str, policy_args: dict, options, codec: RemoteCodec | None) -> tuple[str, dict]:
    """The policy (and its arguments) of the servers started here. A policy with a RemoteCodec runs in SGLang
    (launch=sglang), or in `wamkit serve` only as the stand-in named by server.policy (e.g. cosmos3-standin, which
    gets the adapter's action_stats unless given its own)."""
    if options.launch == "sglang":
        return policy, dict(policy_args)
    if options.policy:
        args = dict(options.policy_args)
        if codec is not None and "action_stats" in policy_args:
            args.setdefault("action_stats", policy_args["action_stats"])
        return options.policy, args
    if codec is not None:
        raise UserError(f"policy {policy!r} runs in {codec.protocol}, not in `wamkit serve`: give server.url=..., "
                        f"or server.launch=sglang (with server.sglang.model_path), or a stand-in for `wamkit serve` "
                        f"with server.policy=cosmos3-standin")
    return policy, dict(policy_args)


def client_token(options, worker, own: str | None = None) -> str | None:
    """The bearer token a client sends to a server: the one a server started here was given (`worker.token`: the
    user's, or this run's own), else the one the config gives (server.token_file, server.token), else the policy's
    own (cosmos3's policy_args.token, for its SGLang server), else the environment's WAMKIT_TOKEN."""
    return (getattr(worker, "token", None) or options.given_token() or own
            or os.environ.get(TOKEN_ENV) or None)


def start_server_workers(policy: str, policy_args: dict, options, worker_factory=None, pinnable: bool = False,
                         log_dir: str | Path | None = None) -> list:
    """Start the `options.replicas` local servers of `options` (ServerOptions: launch, port, batching, token,
    serve_args / sglang; server i sees GPU gpus[i % len] only) and wait until all are healthy: all start first, so
    their model builds and warm-ups overlap. If one fails, those already started are stopped and the error raised.
    pinnable: the caller may pin them later (bench eval's rows with server.reserve_cpus): they start with
    PINNABLE_ENV (core/cpu_pinning.py), as servers pinned from the start do. log_dir: server i's output goes to
    LOG_DIR/server-<i>.log (appended to on a resume or a restart); None: the worker's own place."""
    from wamkit.serve.workers import SGLangServerWorker, WamkitServerWorker

    launch = getattr(options, "launch", "wamkit")
    split = split_cpus(getattr(options, "reserve_cpus", 0) or 0)
    # the `wamkit serve` processes started here require a token: the user's, else a random one for this run (any
    # local user could otherwise use them, and their shared-memory arrays); it reaches them in their environment
    # (WamkitServerWorker; Ray: the actor's arguments), never their command line, and the clients read it from the
    # worker (client_token)
    token = options.auth_token() or secrets.token_urlsafe(32)
    workers = []
    try:
        for i in range(max(1, int(getattr(options, "replicas", 1) or 1))):
            gpus = getattr(options, "gpus", None)
            env = {"CUDA_VISIBLE_DEVICES": str(gpus[i % len(gpus)])} if gpus else None
            # (a worker_factory's servers get it too: Ray's copy their log tail back from their node at stop)
            log_path = Path(log_dir) / f"server-{i}.log" if log_dir is not None else None
            if launch == "sglang":
                kw = dict(getattr(options, "sglang", None) or {})
                if not kw.get("model_path"):
                    raise UserError("server.launch=sglang needs server.sglang.model_path (a diffusers-format model "
                                    "directory SGLang can serve)")
                kw.setdefault("batching_max_size", options.max_batch_size)
                kw.setdefault("batching_delay_ms", options.max_wait_ms)
                if log_path:
                    kw.setdefault("log_path", log_path)   # a log_path in server.sglang wins
                w = (worker_factory or SGLangServerWorker)(port=options.port, env=env, **kw)
                timeout = max(options.startup_timeout_s, SGLangServerWorker.default_start_timeout)
            else:
                kw = dict(policy=policy, policy_args=dict(policy_args), port=options.port,
                          max_batch_size=options.max_batch_size, max_wait_ms=options.max_wait_ms,
                          token=token)
                extra = dict(getattr(options, "serve_args", None) or {})
                if getattr(options, "idle_dispatch", False):
                    extra.setdefault("idle_dispatch", True)
                if getattr(options, "shm_arrays", False):
                    extra.setdefault("shm_arrays", True)
                if extra:
                    kw["extra_args"] = extra
                if env:
                    kw["env"] = env
                if log_path:
                    kw["log_path"] = log_path
                w = (worker_factory or WamkitServerWorker)(**kw)
                timeout = options.startup_timeout_s
            w.default_start_timeout = timeout
            if pinnable:
                w.pinnable = True
            if split and hasattr(w, "set_cpus"):
                w.set_cpus(split[0])
            w.start()
            workers.append(w)
        for w in workers:
            w.wait_healthy(w.default_start_timeout)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers
