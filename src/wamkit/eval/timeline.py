"""Spans of an evaluation run (env simulating, request in flight, server computing), saved as OUT/timeline.json
and drawn as a PNG with one lane per env and per inference side."""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wamkit.core.files import write_atomic

PROGRESS_BINS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)   # Timeline.progress's bin widths, in order
PROGRESS_MAX_BINS = 400


@dataclass
class Span:
    lane: str       # "env/3", "request", "server"
    kind: str       # "reset", "sim", "request", "compute"
    t0: float
    t1: float
    n: int = 1      # observations in a request / batch


def batch_sizes_summary(hist: dict[str, int] | None) -> tuple[int, float, int, int] | None:
    """A {size: count} histogram of the server's batches (Timeline.server_batches, summary.scheduler.server_batches)
    as (batches, mean observations per batch, smallest, largest); None when empty."""
    sizes = {int(k): v for k, v in (hist or {}).items()}
    if not sizes:
        return None
    n = sum(sizes.values())
    return n, sum(k * v for k, v in sizes.items()) / n, min(sizes), max(sizes)


class Timeline:
    def __init__(self, t_origin: float | None = None):
        self.t_origin = time.time() if t_origin is None else t_origin
        self.spans: list[Span] = []

    def add(self, lane: str, kind: str, t0: float, t1: float, n: int = 1) -> None:
        self.spans.append(Span(lane, kind, t0, t1, n))

    def save(self, path: str | Path) -> None:
        """Written atomically (core.files.write_atomic): a run killed while saving leaves the last timeline."""
        write_atomic(path, json.dumps({"t_origin": self.t_origin, "spans": [s.__dict__ for s in self.spans]}))

    @classmethod
    def load(cls, path: str | Path) -> "Timeline":
        """A saved timeline, or a UserError naming the file (a truncated one was a JSONDecodeError traceback)."""
        from wamkit.core.errors import UserError

        try:
            d = json.loads(Path(path).read_text())
            tl = cls(d.get("t_origin"))
            tl.spans = [Span(**s) for s in d["spans"]]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{path} is not a readable timeline ({type(e).__name__}: {e})") from None
        return tl

    @staticmethod
    def _union(intervals: list[tuple[float, float]]) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(intervals):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total

    def utilization(self) -> dict[str, float]:
        if not self.spans:   # (a resumed run with nothing left to run): the same keys, so readers need no case
            return {"wall_s": 0.0, "env_busy": 0.0, "inference_busy": 0.0, "mean_batch": 0.0, "requests": 0,
                    "request_ms_mean": 0.0, "compute_ms_mean": 0.0, **self.env_cycle()}
        t0 = min(s.t0 for s in self.spans)
        t1 = max(s.t1 for s in self.spans)
        wall = max(t1 - t0, 1e-9)
        env_lanes = {s.lane for s in self.spans if s.lane.startswith("env/")}
        env_busy = sum(s.t1 - s.t0 for s in self.spans if s.lane.startswith("env/"))
        compute = [(s.t0, s.t1) for s in self.spans if s.kind == "compute"]
        if not compute:
            compute = [(s.t0, s.t1) for s in self.spans if s.kind == "request"]
        batches = [s.n for s in self.spans if s.kind == "compute"] or [s.n for s in self.spans if s.kind == "request"]
        return {
            "wall_s": wall,
            "env_busy": env_busy / (wall * max(len(env_lanes), 1)),
            "inference_busy": self._union(compute) / wall,
            "mean_batch": sum(batches) / len(batches) if batches else 0.0,
            "requests": len([s for s in self.spans if s.kind == "request"]),
            # per call: the client's round trip and the server's own compute (when the server reports it)
            "request_ms_mean": _mean_ms([s for s in self.spans if s.kind == "request"]),
            "compute_ms_mean": _mean_ms([s for s in self.spans if s.kind == "compute"]),
            **self.env_cycle(),
        }

    def server_batches(self) -> dict[str, int]:
        """The server's batches by size: {size: count} over its distinct compute spans (every request of one batch
        reports the batch's start, end and size, so a batch is one (t0, t1) however many requests it merged). What
        the model ran: with CUDA-graph buckets, a size that is not a bucket ran padded to the next one."""
        seen: dict[tuple[float, float], int] = {}
        for s in self.spans:
            if s.kind == "compute":
                seen[(s.t0, s.t1)] = s.n
        hist: dict[int, int] = {}
        for n in seen.values():
            hist[n] = hist.get(n, 0) + 1
        return {str(k): hist[k] for k in sorted(hist)}

    def env_cycle(self) -> dict[str, float]:
        """An env's cycle inside an episode, mean over every env lane: a chunk simulated ("sim" span: the scheduler's
        call to the env worker, IPC included) and the wait before its next chunk (from a sim span's end to the start
        of the same lane's next sim span: the actions' request, any wait for the rest of a cohort or batch, the event
        loop's dispatch; a reset in between ends the episode and is no such wait). wait - request_ms_mean is then
        about what the envs lose outside the server's round trip (the request mean also counts an episode's first
        request, after its reset)."""
        sims: list[float] = []
        waits: list[float] = []
        lanes: dict[str, list[Span]] = {}
        for s in self.spans:
            if s.lane.startswith("env/"):
                lanes.setdefault(s.lane, []).append(s)
        for spans in lanes.values():
            spans.sort(key=lambda s: s.t0)
            for a, b in zip(spans, spans[1:]):
                if a.kind == "sim" and b.kind == "sim":
                    waits.append(max(b.t0 - a.t1, 0.0))
            sims += [s.t1 - s.t0 for s in spans if s.kind == "sim"]
        return {"sim_ms_mean": _mean_of(sims), "env_wait_ms_mean": _mean_of(waits)}

    def progress(self) -> dict[str, Any]:
        """The run's pace over time, from its first span: the chunks simulated (sim spans, by their end) in each bin
        of `bin_s` seconds (the smallest of PROGRESS_BINS_S giving at most PROGRESS_MAX_BINS bins), and `tail_from_s`,
        when its last episode began (the last reset's start): no episode starts after it, so from there envs fall
        idle one by one. What separates a schedule's own pace from its start (auto's probe) and its end (the tail):
        bench.steady_vs_best_fixed compares rows over the span between. {} without sim spans."""
        sims = [s for s in self.spans if s.kind == "sim"]
        if not sims:
            return {}
        t0 = min(s.t0 for s in self.spans)
        wall = max(s.t1 for s in self.spans) - t0
        bin_s = next((b for b in PROGRESS_BINS_S if wall / b <= PROGRESS_MAX_BINS), PROGRESS_BINS_S[-1])
        chunks = [0] * (int(wall / bin_s) + 1)
        for s in sims:
            chunks[min(int((s.t1 - t0) / bin_s), len(chunks) - 1)] += 1
        resets = [s.t0 - t0 for s in self.spans if s.kind == "reset"]
        return {"bin_s": bin_s, "chunks": chunks, "tail_from_s": round(max(resets), 3) if resets else 0.0,
                "wall_s": round(wall, 3)}

    def draw(self, path: str | Path, max_seconds: float | None = None) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        lanes = sorted({s.lane for s in self.spans if s.lane.startswith("env/")},
                       key=lambda x: int(x.split("/")[1]))
        lanes += [ln for ln in ("request", "server") if any(s.lane == ln for s in self.spans)]
        colors = {"reset": "#bbbbbb", "sim": "#4c72b0", "request": "#dd8452", "compute": "#55a868"}
        t0 = min((s.t0 for s in self.spans), default=0.0)
        fig, ax = plt.subplots(figsize=(14, 0.35 * len(lanes) + 1.5))
        # one broken_barh per (lane, kind): one artist each, so thousands of spans draw in well under a second
        groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for s in self.spans:
            a = s.t0 - t0
            if s.lane in lanes and (max_seconds is None or a <= max_seconds):
                groups.setdefault((s.lane, s.kind), []).append((a, s.t1 - s.t0))
        for (lane, kind), xr in groups.items():
            y = lanes.index(lane)
            # overlapping requests: draw thinner so concurrency stays visible
            h = 0.8 if kind != "request" else 0.25
            ax.broken_barh(xr, (y - h / 2, h), facecolors=colors.get(kind, "k"), alpha=0.85 if h > 0.5 else 0.4)
        ax.set_xlim(left=0)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        u = self.utilization()
        ax.set_title(f"env busy {u['env_busy']:.0%} | inference busy {u['inference_busy']:.0%} | "
                     f"mean batch {u['mean_batch']:.1f}")
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper right", fontsize=7)
        fig.tight_layout()
        p = Path(path)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=90)
        plt.close(fig)
        write_atomic(p, png.getvalue())
        return p


def drop_unreadable_timeline(path: str | Path) -> str | None:
    """A saved timeline that cannot be read (cut short where an older wamkit wrote it in place) is lost: it is moved
    aside to PATH.unreadable, so that the report and later resumes go on without it; returns the one-line warning
    saying so, or None where the file is readable (or absent)."""
    from wamkit.core.errors import UserError

    path = Path(path)
    if not path.exists():
        return None
    try:
        Timeline.load(path)
        return None
    except UserError as e:
        aside = path.with_name(path.name + ".unreadable")
        path.replace(aside)
        return f"{e}: left out of the report, moved to {aside} (the next run that runs episodes writes a new one)"


def _mean_ms(spans) -> float:
    return _mean_of([s.t1 - s.t0 for s in spans])


def _mean_of(seconds: list[float]) -> float:
    """Mean in milliseconds (0 for none)."""
    return 1000.0 * sum(seconds) / len(seconds) if seconds else 0.0
