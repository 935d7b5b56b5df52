"""Server metrics: counters, batch-size histogram, queue-wait and compute-time percentiles (recent window); as JSON
(`snapshot`) and in the Prometheus text exposition format 0.0.4 (`prometheus`), written here without a client
library (what a scrape needs is a few lines of text)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# every counter the server keeps (ServerMetrics.count's names), at 0 from the start: a fresh server already exposes
# each series (wamkit_<name>_total), so dashboards and rate() see them before the first request
COUNTERS = ("requests", "observations", "observations_computed", "batches", "rejected_busy",
            "batches_split_after_error", "decode_unexpected", "body_timeouts", "ws_connections",
            "closed_header_timeout", "closed_connection_cap", "closed_websocket_cap")
_TIMINGS = (("queue_ms", "queue_wait", "time an observation waited for its batch"),
            ("compute_ms", "batch_compute", "policy.predict time per batch"),
            ("request_ms", "request", "time from request received to response sent"))


def wants_prometheus(accept: str) -> bool:
    """A Prometheus scrape asks for OpenMetrics or text/plain; JSON clients, browsers and curl (*/*) get JSON."""
    a = accept.lower()
    if "application/json" in a:
        return False
    return "openmetrics" in a or "text/plain" in a


def _pct(xs, q: float) -> float | None:
    return None if not xs else round(float(np.percentile(np.fromiter(xs, float), q)), 3)


class ServerMetrics:
    def __init__(self, window: int = 10000):
        self.t0 = time.time()
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter({name: 0 for name in COUNTERS})
        self.status: collections.Counter[int] = collections.Counter()
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self.queue_ms: collections.deque[float] = collections.deque(maxlen=window)
        self.compute_ms: collections.deque[float] = collections.deque(maxlen=window)
        self.request_ms: collections.deque[float] = collections.deque(maxlen=window)
        self.totals: dict[str, list[float]] = {name: [0.0, 0] for name, _, _ in _TIMINGS}   # [sum ms, count]

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def response(self, status: int, total_ms: float | None = None) -> None:
        with self._lock:
            self.status[status] += 1
            if total_ms is not None:
                self.request_ms.append(total_ms)
                self._total("request_ms", total_ms)

    def batch(self, size: int, compute_ms: float) -> None:
        with self._lock:
            self.batch_sizes[size] += 1
            self.compute_ms.append(compute_ms)
            self._total("compute_ms", compute_ms)
            self.counts["batches"] += 1
            self.counts["observations_computed"] += size

    def queued(self, queue_ms: float) -> None:
        with self._lock:
            self.queue_ms.append(queue_ms)
            self._total("queue_ms", queue_ms)

    def _total(self, name: str, ms: float) -> None:
        t = self.totals[name]
        t[0] += ms
        t[1] += 1

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

    def prometheus(self, **gauges: float) -> str:
        """The Prometheus text format: counters (`wamkit_<count>_total`, responses by status), the batch-size
        histogram, timing summaries in seconds (p50/p99 of the recent window, cumulative sum/count) and `gauges`."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

        with self._lock:
            counts = dict(self.counts)
            status = dict(self.status)
            sizes = dict(self.batch_sizes)
            windows = {name: list(getattr(self, name)) for name, _, _ in _TIMINGS}
            totals = {k: tuple(v) for k, v in self.totals.items()}
            uptime = time.time() - self.t0
        metric("wamkit_uptime_seconds", "gauge", "seconds since the server started", [("", uptime)])
        for name in sorted(counts):
            metric(f"wamkit_{_ident(name)}_total", "counter", f"count of {name.replace('_', ' ')}",
                   [("", counts[name])])
        metric("wamkit_responses_total", "counter", "responses by HTTP status",
               [(f'{{status="{k}"}}', v) for k, v in sorted(status.items())])
        buckets, acc = [], 0
        for le in BATCH_BUCKETS:
            acc = sum(v for k, v in sizes.items() if k <= le)
            buckets.append((f'_bucket{{le="{le}"}}', acc))
        n = sum(sizes.values())
        buckets += [('_bucket{le="+Inf"}', n), ("_sum", sum(k * v for k, v in sizes.items())), ("_count", n)]
        lines.append("# HELP wamkit_batch_size observations per policy.predict batch")
        lines.append("# TYPE wamkit_batch_size histogram")
        lines.extend(f"wamkit_batch_size{suffix} {_num(v)}" for suffix, v in buckets)
        for key, name, help_ in _TIMINGS:
            full = f"wamkit_{name}_seconds"
            xs = windows[key]
            lines.append(f"# HELP {full} {help_} (quantiles over the last {self.queue_ms.maxlen} values)")
            lines.append(f"# TYPE {full} summary")
            for q in (0.5, 0.99):
                v = _pct(xs, q * 100)
                lines.append(f'{full}{{quantile="{q}"}} {_num(float("nan") if v is None else v / 1000.0)}')
            lines.append(f"{full}_sum {_num(totals[key][0] / 1000.0)}")
            lines.append(f"{full}_count {_num(totals[key][1])}")
        for name, v in sorted(gauges.items()):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metric(f"wamkit_{_ident(name)}", "gauge", name.replace("_", " "), [("", v)])
        return "\n".join(lines) + "\n"


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def _num(v: float) -> str:
    if isinstance(v, float):
        if v != v:
            return "NaN"
        return repr(v) if not v.is_integer() else str(int(v)) if abs(v) < 1e15 else repr(v)
    return str(v)
