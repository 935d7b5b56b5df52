"""Where action chunks come from during an evaluation: the policy in this process, or an action server over HTTP.

Both are asynchronous: `await predict(observations, seeds)` never blocks the scheduler's event loop, and several
calls may be in flight. Every call records a span on the timeline (request in flight; server computing)."""

from __future__ import annotations

import abc
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from wamkit.core.types import Observation
from wamkit.eval.timeline import Timeline

class Inference(abc.ABC):
    max_batch: int = 64
    name: str = ""

    def __init__(self, timeline: Timeline | None = None):
        self.timeline = timeline
        self.observations = 0
        self.requests = 0
        self.latencies: list[tuple[int, float]] = []   # (batch size, seconds) of every call

    async def start(self) -> None:  # noqa: B027
        pass

    async def close(self) -> None:  # noqa: B027
        pass

    @abc.abstractmethod
    async def _predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        ...

    async def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        t0 = time.time()
        out = await self._predict(observations, seeds)
        t1 = time.time()
        self.observations += len(observations)
        self.requests += 1
        self.latencies.append((len(observations), t1 - t0))
        if self.timeline is not None:
            self.timeline.add("request", "request", t0, t1, len(observations))
        return out


class InProcessInference(Inference):
    """The policy in this process, on one worker thread (the event loop keeps scheduling envs meanwhile)."""

    name = "inprocess"

    def __init__(self, policy, timeline: Timeline | None = None):
        super().__init__(timeline)
        self.policy = policy
        self.max_batch = int(policy.max_batch_size())
        policy.warmup(self.max_batch)  # one-off work (e.g. CUDA graphs of every batch size) before any timing
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="policy")

    def _run(self, observations, seeds):
        t0 = time.time()
        out = self.policy.predict(list(observations), list(seeds))
        if self.timeline is not None:
            self.timeline.add("server", "compute", t0, time.time(), len(observations))
        return out

    async def _predict(self, observations, seeds):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._run, observations, seeds)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)


class ServerInference(Inference):
    """An action server over HTTP: a local `wamkit serve` started here (and restarted by the client when it stops
    answering: the request is then retried), or an existing URL (`server.url=`, wamkit serve or SGLang)."""

    name = "server"

    def __init__(self, *, policy: str, policy_args: dict, options, timeline: Timeline | None = None,
                 worker_factory=None):
        super().__init__(timeline)
        self.policy_name, self.policy_args, self.options = policy, dict(policy_args), options
        self.worker_factory = worker_factory     # None: a local `wamkit serve` subprocess
        self.worker = None
        self.client = None

    @property
    def restarts(self) -> int:
        return 0 if self.worker is None else max(0, self.worker.starts - 1)

    async def start(self) -> None:
        from wamkit.serve.client import ActionClient
        from wamkit.serve.workers import WamkitServerWorker

        url = self.options.url
        if url is None:
            self.worker = (self.worker_factory or WamkitServerWorker)(policy=self.policy_name, policy_args=self.policy_args,
                                             port=self.options.port, max_batch_size=self.options.max_batch_size,
                                             max_wait_ms=self.options.max_wait_ms, token=self.options.token)
            self.worker.default_start_timeout = self.options.startup_timeout_s
            await asyncio.to_thread(self.worker.start)
            await asyncio.to_thread(self.worker.wait_healthy, self.options.startup_timeout_s)
            url = self.worker.url
        self.client = ActionClient(url, token=self.options.token, on_timing=self._on_timing, worker=self.worker)
        self.max_batch = await self.client.server_max_batch()

    def _on_timing(self, rec: dict) -> None:
        t = rec.get("server") or {}
        if self.timeline is not None and "t_start" in t:
            self.timeline.add("server", "compute", float(t["t_start"]), float(t["t_end"]),
                              int(t.get("batch_size", rec.get("n", 1))))

    async def _predict(self, observations, seeds):
        return await self.client.predict(list(observations), list(seeds))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop)
