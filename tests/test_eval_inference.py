"""ServerInference with several servers: what each replica is started with, and least-loaded dispatch."""

from __future__ import annotations

import asyncio

import numpy as np

from wamkit.core.config import load_config
from wamkit.eval.config import EvalConfig
from wamkit.eval.inference import ServerInference


class FakeWorker:
    def __init__(self, **kw):
        self.kw, self.starts = kw, 0

    def start(self):
        self.starts += 1


def test_replicas_get_their_gpu_and_the_serve_args():
    cfg = load_config(EvalConfig, None, ["server.replicas=3", "server.gpus=0,1", "server.serve_args.torch_threads=2"])
    inf = ServerInference(policy="zero", policy_args={"horizon": 4}, options=cfg.server, worker_factory=FakeWorker)
    ws = [inf._start_worker(i) for i in range(3)]
    assert [w.kw["env"]["CUDA_VISIBLE_DEVICES"] for w in ws] == ["0", "1", "0"]
    assert all(w.kw["extra_args"] == {"torch_threads": 2} and w.kw["policy"] == "zero" for w in ws)
    plain = ServerInference(policy="zero", policy_args={}, options=load_config(EvalConfig, None, []).server,
                            worker_factory=FakeWorker)._start_worker(0)
    assert "env" not in plain.kw and "extra_args" not in plain.kw   # factories without those keys keep working


def test_requests_go_to_the_least_loaded_server():
    class Client:
        def __init__(self, delay):
            self.delay, self.calls = delay, 0

        async def predict(self, obs, seeds):
            self.calls += 1
            await asyncio.sleep(self.delay)
            return np.zeros((len(obs), 2, 1), np.float32)

    inf = ServerInference(policy="zero", policy_args={}, options=load_config(EvalConfig, None, []).server)
    slow, fast = Client(0.2), Client(0.01)
    inf.clients, inf.in_flight, inf.served = [slow, fast], [0, 0], [0, 0]

    async def main():
        first = asyncio.create_task(inf.predict([None] * 4, [0] * 4))   # goes to server 0 (tie: round robin)
        await asyncio.sleep(0.01)
        for _ in range(5):                 # server 0 is busy with 4 observations: these go to server 1
            await inf.predict([None], [0])
        await first

    asyncio.run(main())
    assert (slow.calls, fast.calls) == (1, 5) and inf.served == [1, 5] and inf.in_flight == [0, 0]
