"""Server metrics: counters, batch-size histogram, queue-wait and compute-time percentiles (recent window)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np


def _pct(xs, q: float) -> float | None:
    return None if not xs else round(float(np.percentile(np.fromiter(xs, float), q)), 3)


class ServerMetrics:
    def __init__(self, window: int = 10000):
        self.t0 = time.time()
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.status: collections.Counter[int] = collections.Counter()
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self.queue_ms: collections.deque[float] = collections.deque(maxlen=window)
        self.compute_ms: collections.deque[float] = collections.deque(maxlen=window)
        self.request_ms: collections.deque[float] = collections.deque(maxlen=window)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def response(self, status: int, total_ms: float | None = None) -> None:
        with self._lock:
            self.status[status] += 1
            if total_ms is not None:
                self.request_ms.append(total_ms)

    def batch(self, size: int, compute_ms: float) -> None:
        with self._lock:
            self.batch_sizes[size] += 1
            self.compute_ms.append(compute_ms)
            self.counts["batches"] += 1
            self.counts["observations_computed"] += size

    def queued(self, queue_ms: float) -> None:
        with self._lock:
            self.queue_ms.append(queue_ms)

    def snapshot(self, **extra: Any) -> dict[str, Any]:
        with self._lock:
            nb = sum(self.batch_sizes.values())
            mean_b = (sum(k * v for k, v in self.batch_sizes.items()) / nb) if nb else None
            return {
                "uptime_s": round(time.time() - self.t0, 3),
                "counts": dict(self.counts),
                "responses_by_status": {str(k): v for k, v in sorted(self.status.items())},
                "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "mean_batch_size": None if mean_b is None else round(mean_b, 3),
                "max_batch_size_seen": max(self.batch_sizes) if self.batch_sizes else 0,
                "queue_ms": {"p50": _pct(self.queue_ms, 50), "p99": _pct(self.queue_ms, 99), "n": len(self.queue_ms)},
                "compute_ms": {"p50": _pct(self.compute_ms, 50), "p99": _pct(self.compute_ms, 99),
                               "n": len(self.compute_ms)},
                "request_ms": {"p50": _pct(self.request_ms, 50), "p99": _pct(self.request_ms, 99),
                               "n": len(self.request_ms)},
                **extra,
            }
