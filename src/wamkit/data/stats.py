"""Per-episode feature statistics and their aggregation, in LeRobot v3's shapes.

Stats per feature: min, max, mean, std, count, q01, q10, q50, q90, q99.
- numeric features: over frames, per channel (shape (D,)); `count` = [num_frames].
- image/video features: over sampled frames and pixels, per channel, scaled to [0, 1], shape (3, 1, 1) (lerobot's
  layout); frames sampled like lerobot (all frames up to 100, then ~len**0.75 evenly spaced, at most 10000), images
  of 300 px or more strided down to ~150 px.
Aggregation over episodes: min of mins, max of maxes, count-weighted mean, pooled variance, count-weighted average of
the per-episode quantiles (what lerobot 0.6 does; it is an approximation of the global quantiles).
Per-episode quantiles are exact (numpy, linear interpolation); lerobot estimates them with running histograms, so
quantiles written by the two differ slightly.
"""

from __future__ import annotations

import numpy as np

STAT_KEYS = ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99")
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def num_stat_samples(n: int, min_samples: int = 100, max_samples: int = 10_000, power: float = 0.75) -> int:
    if n < min_samples:
        return n
    return max(min_samples, min(int(n ** power), max_samples))


def sample_frame_indices(n: int) -> np.ndarray:
    return np.round(np.linspace(0, n - 1, num_stat_samples(n))).astype(int)


def _stats(arr: np.ndarray, axis, keepdims: bool) -> dict[str, np.ndarray]:
    arr = np.asarray(arr, dtype=np.float64)
    out = {
        "min": arr.min(axis=axis, keepdims=keepdims),
        "max": arr.max(axis=axis, keepdims=keepdims),
        "mean": arr.mean(axis=axis, keepdims=keepdims),
        "std": arr.std(axis=axis, keepdims=keepdims),
        "count": np.array([arr.shape[0]], dtype=np.int64),
    }
    qs = np.quantile(arr, list(QUANTILES.values()), axis=axis, keepdims=keepdims)
    for j, k in enumerate(QUANTILES):
        out[k] = qs[j]
    return {k: out[k] for k in STAT_KEYS}


def numeric_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """(N,) or (N, D) -> stats of shape (D,) ((1,) for scalars)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 1:
        v = v[:, None]
    return _stats(v.reshape(v.shape[0], -1), axis=0, keepdims=False)


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """(N, H, W, 3) uint8 frames -> per-channel stats of shape (3, 1, 1) on [0, 1] (count = frames used)."""
    frames = np.asarray(frames)
    idx = sample_frame_indices(len(frames))
    x = frames[idx]
    h, w = x.shape[1:3]
    if max(h, w) >= 300:
        step = int((w if w > h else h) / 150)
        x = x[:, ::step, ::step]
    chw = np.transpose(x, (0, 3, 1, 2)).astype(np.float64) / 255.0  # (N, 3, H, W)
    s = _stats(chw, axis=(0, 2, 3), keepdims=True)
    return {k: (v if k == "count" else v[0]) for k, v in s.items()}


def aggregate_stats(per_episode: list[dict[str, dict[str, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    keys: list[str] = []
    for s in per_episode:
        for k in s:
            if k not in keys:
                keys.append(k)
    out = {}
    for key in keys:
        ss = [s[key] for s in per_episode if key in s]
        counts = np.array([float(np.asarray(s["count"]).reshape(-1)[0]) for s in ss])
        total = counts.sum()
        shape = np.asarray(ss[0]["mean"]).shape
        w = counts.reshape(-1, *([1] * len(shape)))
        means = np.stack([np.asarray(s["mean"], dtype=np.float64) for s in ss])
        var = np.stack([np.asarray(s["std"], dtype=np.float64) ** 2 for s in ss])
        mean = (means * w).sum(0) / total
        pooled = ((var + (means - mean) ** 2) * w).sum(0) / total
        agg = {
            "min": np.min(np.stack([s["min"] for s in ss]), axis=0),
            "max": np.max(np.stack([s["max"] for s in ss]), axis=0),
            "mean": mean,
            "std": np.sqrt(pooled),
            "count": np.array([int(total)], dtype=np.int64),
        }
        for q in QUANTILES:
            if all(q in s for s in ss):
                agg[q] = (np.stack([np.asarray(s[q], dtype=np.float64) for s in ss]) * w).sum(0) / total
        out[key] = agg
    return out


def stats_to_json(stats: dict[str, dict[str, np.ndarray]]) -> dict:
    return {k: {sk: np.asarray(sv).tolist() for sk, sv in v.items()} for k, v in stats.items()}
