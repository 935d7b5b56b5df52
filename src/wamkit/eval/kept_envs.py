"""One set of env workers lent to several evaluation runs (the demo's stages, `wamkit bench eval`'s rows): the
simulators start once, not once per run."""

from __future__ import annotations

import json
from typing import Any


class KeptEnvs:
    """One set of env workers for every run of a stage: run_eval's `env_workers` factory hands out the same started
    workers (their start() and close() are no-ops for run_eval; `close()` here ends them)."""

    def __init__(self):
        self.workers: list = []
        self.key: tuple | None = None

    def __call__(self, env: str, kwargs: dict[str, Any], n: int) -> list:
        key = (env, json.dumps(kwargs, sort_keys=True, default=str))
        if self.key is not None and key != self.key:
            raise ValueError(f"KeptEnvs serves one env configuration; got {key} after {self.key}")
        self.key = key
        if len(self.workers) < n:
            from wamkit.eval.runner import local_env_workers

            self.workers += local_env_workers(env, kwargs, n)[len(self.workers):]   # indices stay 0..n-1
        return [_Kept(w) for w in self.workers[:n]]

    def close(self) -> None:
        for w in self.workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001
                pass
        self.workers = []


class _Kept:
    """A started worker lent to one run: start() starts it only if it is not running, close() keeps it running."""

    def __init__(self, worker):
        self._w = worker

    def start(self):
        self._w.start()
        return self

    def close(self, *a, **k) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self._w, name)
