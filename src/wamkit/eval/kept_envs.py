"""One set of env workers lent to several evaluation runs (the demo's stages, `wamkit bench eval`'s rows): the
simulators start once, not once per run."""

from __future__ import annotations

import json
from typing import Any


class KeptEnvs:
    """The started env workers of every run of a stage: run_eval's `env_workers` factory hands out the same started
    workers (their start() and close() are no-ops for run_eval; `close()` here ends them). One set per env
    configuration: a bench row that changes env_args (e.g. `@ env_args.renderer=shared`) gets a set of its own,
    kept for its later rounds."""

    def __init__(self):
        self.sets: dict[tuple, list] = {}

    @property
    def workers(self) -> list:
        return [w for ws in self.sets.values() for w in ws]

    def __call__(self, env: str, kwargs: dict[str, Any], n: int) -> list:
        key = (env, json.dumps(kwargs, sort_keys=True, default=str))
        workers = self.sets.setdefault(key, [])
        if len(workers) < n:
            from wamkit.eval.runner import local_env_workers

            workers += local_env_workers(env, kwargs, n)[len(workers):]   # indices stay 0..n-1
        return [_Kept(w) for w in workers[:n]]

    def close(self) -> None:
        for w in self.workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001
                pass
        self.sets = {}


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
