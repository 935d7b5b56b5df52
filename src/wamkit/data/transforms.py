"""Action transforms: rot6d, gripper convention, quantile normalization, a saveable pipeline, action stats.

Conventions (pinned by tests/test_data_transforms.py; this module is the one place they live):

- 7-D action: ``[dx, dy, dz, ax, ay, az, gripper]`` with the rotation as an axis-angle (rotation vector).
- 10-D action: ``[dx, dy, dz, r6d (6), gripper]``; ``r6d = R[:, :2].T.reshape(6)`` i.e. the first two COLUMNS of the
  rotation matrix, column by column: ``[R00, R10, R20, R01, R11, R21]``.
- 10-D -> 7-D: ``c2 = c0 x c1``, ``M = [c0 c1 c2]`` (columns), projected to SO(3) by SVD (``U @ Vt``, flipping U's last
  column when the determinant is negative), then matrix -> rotation vector (stable near pi).
- Gripper: dataset ``g`` in [0, 1] with 1 = open; env ``1 - 2g`` (-1 open, +1 close). Inverse ``(1 - e) / 2``.
- Quantile normalization: ``n = 2 * (a - q01) / max(q99 - q01, eps) - 1``; inverse ``(n + 1) / 2 * (q99 - q01) + q01``
  (the inverse uses the same clamped range, so forward/inverse round-trip even on constant channels).

``ActionPipeline.forward`` goes from env/dataset space to model space; ``inverse`` from model space back to env space.
Steps are applied in order by ``forward`` and in reverse order by ``inverse``. A pipeline is saved as JSON
(``to_dict``/``from_dict``, ``save``/``load``), statistics included, like LeRobot's processor pipelines.

Everything is numpy in / numpy out (float64 math internally, float32 out unless the input was float64); torch tensors
are accepted and converted (results are numpy).
"""

from __future__ import annotations

import abc

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = [
    "axis_angle_to_matrix",
    "matrix_to_axis_angle",
    "axis_angle_to_rot6d",
    "rot6d_to_matrix",
    "rot6d_to_axis_angle",
    "actions7_to_10",
    "actions10_to_7",
    "gripper_01_to_env",
    "gripper_env_to_01",
    "QuantileNormalizer",
    "Step",
    "Rot6dStep",
    "GripperStep",
    "QuantileNormalizeStep",
    "ActionPipeline",
    "register_step",
    "compute_action_stats",
]


# ----------------------------------------------------------------------------------------------- array helpers

def _np(x: Any) -> np.ndarray:
    """numpy view of x (torch tensors are detached and moved to CPU)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _out_dtype(x: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)


# ----------------------------------------------------------------------------------------------- rotations

def axis_angle_to_matrix(aa) -> np.ndarray:
    """Rotation vectors (..., 3) -> rotation matrices (..., 3, 3) (Rodrigues; float64)."""
    aa = _np(aa).astype(np.float64)
    theta = np.linalg.norm(aa, axis=-1)[..., None, None]  # (...,1,1)
    x, y, z = aa[..., 0], aa[..., 1], aa[..., 2]
    zero = np.zeros_like(x)
    K = np.stack([np.stack([zero, -z, y], -1), np.stack([z, zero, -x], -1), np.stack([-y, x, zero], -1)], -2)
    small = theta < 1e-6
    t = np.where(small, 1.0, theta)
    # sin(t)/t and (1-cos t)/t^2 with Taylor series for tiny angles
    a = np.where(small, 1.0 - theta ** 2 / 6.0, np.sin(t) / t)
    b = np.where(small, 0.5 - theta ** 2 / 24.0, (1.0 - np.cos(t)) / (t * t))
    eye = np.broadcast_to(np.eye(3), K.shape)
    return eye + a * K + b * (K @ K)


def matrix_to_axis_angle(R) -> np.ndarray:
    """Rotation matrices (..., 3, 3) -> rotation vectors (..., 3), angle in [0, pi]; numerically right near 0 and pi.

    Goes through a unit quaternion chosen by the largest-diagonal rule (Shepperd), which is stable everywhere,
    then ``2 * atan2(|v|, w)`` with ``w >= 0``.
    """
    R = _np(R).astype(np.float64)
    shape = R.shape[:-2]
    R = R.reshape(-1, 3, 3)
    m00, m11, m22 = R[:, 0, 0], R[:, 1, 1], R[:, 2, 2]
    tr = m00 + m11 + m22
    cand = np.stack([tr, m00, m11, m22], -1)
    k = np.argmax(cand, -1)
    q = np.empty((R.shape[0], 4))  # w, x, y, z
    # case 0: trace largest
    s = np.sqrt(np.maximum(1.0 + tr, 1e-300)) * 2.0
    q0 = np.stack([0.25 * s, (R[:, 2, 1] - R[:, 1, 2]) / s, (R[:, 0, 2] - R[:, 2, 0]) / s,
                   (R[:, 1, 0] - R[:, 0, 1]) / s], -1)
    s = np.sqrt(np.maximum(1.0 + m00 - m11 - m22, 1e-300)) * 2.0
    q1 = np.stack([(R[:, 2, 1] - R[:, 1, 2]) / s, 0.25 * s, (R[:, 0, 1] + R[:, 1, 0]) / s,
                   (R[:, 0, 2] + R[:, 2, 0]) / s], -1)
    s = np.sqrt(np.maximum(1.0 - m00 + m11 - m22, 1e-300)) * 2.0
    q2 = np.stack([(R[:, 0, 2] - R[:, 2, 0]) / s, (R[:, 0, 1] + R[:, 1, 0]) / s, 0.25 * s,
                   (R[:, 1, 2] + R[:, 2, 1]) / s], -1)
    s = np.sqrt(np.maximum(1.0 - m00 - m11 + m22, 1e-300)) * 2.0
    q3 = np.stack([(R[:, 1, 0] - R[:, 0, 1]) / s, (R[:, 0, 2] + R[:, 2, 0]) / s, (R[:, 1, 2] + R[:, 2, 1]) / s,
                   0.25 * s], -1)
    allq = np.stack([q0, q1, q2, q3], 1)
    q = allq[np.arange(R.shape[0]), k]
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    q = np.where(q[:, :1] < 0, -q, q)
    w, v = q[:, 0], q[:, 1:]
    vn = np.linalg.norm(v, axis=-1)
    angle = 2.0 * np.arctan2(vn, w)
    small = vn < 1e-12
    # angle / sin(angle/2) -> 2 for tiny angles (sin(angle/2) == vn for a unit quaternion)
    scale = np.where(small, 2.0 / np.maximum(w, 1e-300), angle / np.where(small, 1.0, vn))
    return (v * scale[:, None]).reshape(*shape, 3)


def axis_angle_to_rot6d(aa) -> np.ndarray:
    """(..., 3) rotation vectors -> (..., 6) ``[R00, R10, R20, R01, R11, R21]`` (first two columns, column by column)."""
    a = _np(aa)
    R = axis_angle_to_matrix(a)
    r6 = np.swapaxes(R[..., :, :2], -1, -2).reshape(*R.shape[:-2], 6)
    return r6.astype(_out_dtype(a))


def rot6d_to_matrix(r6) -> np.ndarray:
    """(..., 6) -> (..., 3, 3): columns c0, c1, c0 x c1, projected to SO(3) by SVD (float64)."""
    r6 = _np(r6).astype(np.float64)
    c0, c1 = r6[..., 0:3], r6[..., 3:6]
    c2 = np.cross(c0, c1)
    M = np.stack([c0, c1, c2], -1)  # columns
    U, _, Vt = np.linalg.svd(M)
    det = np.linalg.det(U @ Vt)
    U = U.copy()
    U[..., :, 2] *= np.where(det < 0, -1.0, 1.0)[..., None]
    return U @ Vt


def rot6d_to_axis_angle(r6) -> np.ndarray:
    """(..., 6) rot6d -> (..., 3) rotation vectors (inverse of :func:`axis_angle_to_rot6d`)."""
    a = _np(r6)
    return matrix_to_axis_angle(rot6d_to_matrix(a)).astype(_out_dtype(a))


def actions7_to_10(a) -> np.ndarray:
    """(..., 7) ``[pos3, rotvec3, g]`` -> (..., 10) ``[pos3, rot6d, g]``."""
    a = _np(a)
    if a.shape[-1] != 7:
        raise ValueError(f"actions7_to_10 expects a last dimension of 7, got shape {a.shape}")
    dt = _out_dtype(a)
    return np.concatenate([a[..., 0:3].astype(dt), axis_angle_to_rot6d(a[..., 3:6]).astype(dt),
                           a[..., 6:7].astype(dt)], -1)


def actions10_to_7(a) -> np.ndarray:
    """(..., 10) ``[pos3, rot6d, g]`` -> (..., 7) ``[pos3, rotvec3, g]``."""
    a = _np(a)
    if a.shape[-1] != 10:
        raise ValueError(f"actions10_to_7 expects a last dimension of 10, got shape {a.shape}")
    dt = _out_dtype(a)
    return np.concatenate([a[..., 0:3].astype(dt), rot6d_to_axis_angle(a[..., 3:9]).astype(dt),
                           a[..., 9:10].astype(dt)], -1)


# ----------------------------------------------------------------------------------------------- gripper

def gripper_01_to_env(g) -> np.ndarray:
    """Dataset gripper in [0, 1] (1 = open) -> env gripper (-1 = open, +1 = close): ``1 - 2g``."""
    g = _np(g)
    return (1.0 - 2.0 * g).astype(_out_dtype(g))


def gripper_env_to_01(e) -> np.ndarray:
    """Env gripper (-1 open, +1 close) -> dataset [0, 1] (1 = open): ``(1 - e) / 2``."""
    e = _np(e)
    return ((1.0 - e) / 2.0).astype(_out_dtype(e))


# ----------------------------------------------------------------------------------------------- normalizer

class QuantileNormalizer:
    """Per-channel quantile normalization to [-1, 1]: ``2 * (a - q01) / max(q99 - q01, eps) - 1``.

    clip=True clips the normalized values to [-1, 1] (SGLang's behaviour); the inverse clips its input likewise.
    """

    def __init__(self, q01, q99, eps: float = 1e-8, clip: bool = False):
        self.q01 = np.asarray(_np(q01), dtype=np.float64).reshape(-1)
        self.q99 = np.asarray(_np(q99), dtype=np.float64).reshape(-1)
        if self.q01.shape != self.q99.shape:
            raise ValueError(f"q01 {self.q01.shape} and q99 {self.q99.shape} differ in shape")
        self.eps = float(eps)
        self.clip = bool(clip)

    @property
    def dim(self) -> int:
        return int(self.q01.shape[0])

    def _range(self) -> np.ndarray:
        return np.maximum(self.q99 - self.q01, self.eps)

    def _check(self, a: np.ndarray) -> None:
        if a.shape[-1] != self.dim:
            raise ValueError(f"normalizer has {self.dim} channels, got array of shape {a.shape}")

    def normalize(self, a) -> np.ndarray:
        a = _np(a)
        self._check(a)
        n = 2.0 * (a.astype(np.float64) - self.q01) / self._range() - 1.0
        if self.clip:
            n = np.clip(n, -1.0, 1.0)
        return n.astype(_out_dtype(a))

    def denormalize(self, n) -> np.ndarray:
        n = _np(n)
        self._check(n)
        x = n.astype(np.float64)
        if self.clip:
            x = np.clip(x, -1.0, 1.0)
        return ((x + 1.0) / 2.0 * self._range() + self.q01).astype(_out_dtype(n))

    __call__ = normalize

    def to_dict(self) -> dict:
        return {"q01": self.q01.tolist(), "q99": self.q99.tolist(), "eps": self.eps, "clip": self.clip}

    @classmethod
    def from_dict(cls, d: dict) -> "QuantileNormalizer":
        return cls(d["q01"], d["q99"], eps=d.get("eps", 1e-8), clip=d.get("clip", False))

    def __repr__(self) -> str:
        return f"QuantileNormalizer(dim={self.dim}, eps={self.eps}, clip={self.clip})"


# ----------------------------------------------------------------------------------------------- pipeline steps

_STEPS: dict[str, type["Step"]] = {}


def register_step(cls: type["Step"]) -> type["Step"]:
    """Class decorator: make a Step loadable by ``ActionPipeline.from_dict`` under ``cls.name``."""
    if not getattr(cls, "name", None):
        raise ValueError(f"{cls.__name__} needs a class attribute `name`")
    _STEPS[cls.name] = cls
    return cls


class Step(abc.ABC):
    """One invertible action transform. ``forward``: env/dataset -> model; ``inverse``: model -> env/dataset."""

    name: str = ""

    @abc.abstractmethod
    def forward(self, a: np.ndarray) -> np.ndarray:
        """env/dataset space -> model space."""

    @abc.abstractmethod
    def inverse(self, a: np.ndarray) -> np.ndarray:
        """model space -> env/dataset space."""

    def out_dim(self, in_dim: int) -> int:
        return in_dim

    def config(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        return {"type": self.name, **self.config()}

    @classmethod
    def from_config(cls, cfg: dict) -> "Step":
        return cls(**cfg)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config()})"


@register_step
class Rot6dStep(Step):
    """7-D ``[pos, rotvec, g]`` <-> 10-D ``[pos, rot6d, g]``."""

    name = "rot6d"

    def forward(self, a):
        return actions7_to_10(a)

    def inverse(self, a):
        return actions10_to_7(a)

    def out_dim(self, in_dim: int) -> int:
        if in_dim != 7:
            raise ValueError(f"Rot6dStep needs 7-D actions, got {in_dim}")
        return 10


@register_step
class GripperStep(Step):
    """Gripper channel convention. ``forward``: env (-1 open/+1 close) -> dataset [0,1] (1 open); ``inverse``: back.

    With ``direction="01_to_env"`` the roles are swapped (forward maps [0,1] -> env). ``index`` is the channel
    (default: the last one).

    ``on_forward=False`` makes ``forward`` the identity while ``inverse`` still converts: for datasets that already
    store the gripper in model space ([0,1], NVIDIA's LIBERO_LeRobot_v3) whose env wants -1/+1
    (``GripperStep(on_forward=False)``: dataset [0,1] -> model [0,1] -> env ``1 - 2g``).
    """

    name = "gripper"

    def __init__(self, index: int = -1, direction: str = "env_to_01", on_forward: bool = True):
        if direction not in ("env_to_01", "01_to_env"):
            raise ValueError(f"GripperStep direction must be env_to_01 or 01_to_env, got {direction!r}")
        self.index = int(index)
        self.direction = direction
        self.on_forward = bool(on_forward)

    def _apply(self, a, fn):
        a = _np(a)
        out = a.astype(_out_dtype(a), copy=True)
        out[..., self.index] = fn(a[..., self.index])
        return out

    def forward(self, a):
        if not self.on_forward:
            a = _np(a)
            return a.astype(_out_dtype(a), copy=True)
        return self._apply(a, gripper_env_to_01 if self.direction == "env_to_01" else gripper_01_to_env)

    def inverse(self, a):
        return self._apply(a, gripper_01_to_env if self.direction == "env_to_01" else gripper_env_to_01)

    def config(self) -> dict:
        return {"index": self.index, "direction": self.direction, "on_forward": self.on_forward}


@register_step
class QuantileNormalizeStep(Step):
    """Quantile normalization (forward = normalize, inverse = denormalize); stats saved with the step."""

    name = "quantile_normalize"

    def __init__(self, q01=None, q99=None, eps: float = 1e-8, clip: bool = False,
                 normalizer: QuantileNormalizer | None = None):
        if normalizer is None:
            if q01 is None or q99 is None:
                raise ValueError("QuantileNormalizeStep needs q01 and q99 (or a QuantileNormalizer)")
            normalizer = QuantileNormalizer(q01, q99, eps=eps, clip=clip)
        self.normalizer = normalizer

    def forward(self, a):
        return self.normalizer.normalize(a)

    def inverse(self, a):
        return self.normalizer.denormalize(a)

    def out_dim(self, in_dim: int) -> int:
        if in_dim != self.normalizer.dim:
            raise ValueError(f"QuantileNormalizeStep has {self.normalizer.dim} channels, input has {in_dim}")
        return in_dim

    def config(self) -> dict:
        return self.normalizer.to_dict()


class ActionPipeline:
    """An ordered, saveable list of invertible action steps (LeRobot processor style).

        pipe = ActionPipeline([Rot6dStep(), QuantileNormalizeStep(q01, q99)])
        model_actions = pipe.forward(env_actions)       # (..., 7) -> (..., 10) in [-1, 1]
        env_actions = pipe.inverse(model_actions)       # (..., 10) -> (..., 7)
        pipe.save("action_pipeline.json"); pipe = ActionPipeline.load("action_pipeline.json")
    """

    VERSION = 1

    def __init__(self, steps: Sequence[Step] = ()):
        self.steps = list(steps)

    def forward(self, a) -> np.ndarray:
        x = _np(a)
        for s in self.steps:
            x = s.forward(x)
        return np.asarray(x)

    __call__ = forward

    def inverse(self, a) -> np.ndarray:
        x = _np(a)
        for s in reversed(self.steps):
            x = s.inverse(x)
        return np.asarray(x)

    def out_dim(self, in_dim: int) -> int:
        d = in_dim
        for s in self.steps:
            d = s.out_dim(d)
        return d

    def without_normalization(self) -> "ActionPipeline":
        """The same pipeline minus its QuantileNormalizeStep(s) (what stats are computed through)."""
        return ActionPipeline([s for s in self.steps if not isinstance(s, QuantileNormalizeStep)])

    def to_dict(self) -> dict:
        return {"format": "wamkit.action_pipeline", "version": self.VERSION, "steps": [s.to_dict() for s in self.steps]}

    @classmethod
    def from_dict(cls, d: dict) -> "ActionPipeline":
        steps = []
        for sd in d.get("steps", []):
            sd = dict(sd)
            typ = sd.pop("type", None)
            if typ not in _STEPS:
                from wamkit.core.errors import unknown_choice

                raise unknown_choice("action pipeline step", typ, sorted(_STEPS))
            steps.append(_STEPS[typ].from_config(sd))
        return cls(steps)

    def save(self, path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2))
        return p

    @classmethod
    def load(cls, path) -> "ActionPipeline":
        from wamkit.core.errors import UserError

        p = Path(path)
        if not p.exists():
            raise UserError(f"action pipeline file not found: {p}")
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"action pipeline file {p} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        return f"ActionPipeline({self.steps!r})"


# ----------------------------------------------------------------------------------------------- stats

def _chunk_reader(dataset, horizon: int):
    """A function idx -> (actions (H, D), mask (H,)) for a wamkit LeRobotDataset or anything array-like."""
    if hasattr(dataset, "get_action_chunk"):
        return len(dataset), lambda i: dataset.get_action_chunk(i, horizon)
    arr = _np(dataset)
    if arr.ndim == 3:  # already chunks (N, H, D)
        return arr.shape[0], lambda i: (arr[i], np.ones(arr.shape[1], bool))
    if arr.ndim == 2:  # one flat (T, D) stream of actions
        n = arr.shape[0]

        def get(i):
            idx = np.minimum(np.arange(i, i + horizon), n - 1)
            return arr[idx], np.arange(i, i + horizon) < n

        return n, get
    raise ValueError(f"compute_action_stats: unsupported dataset of shape {arr.shape}")


def compute_action_stats(dataset, horizon: int = 16, pipeline_before_norm: ActionPipeline | None = None,
                         num_chunks: int | None = 10000, seed: int = 0, include_padded: bool = False) -> dict:
    """Per-channel stats of action chunks, after ``pipeline_before_norm`` (e.g. ``ActionPipeline([Rot6dStep()])``).

    dataset: a ``wamkit.data.lerobot.LeRobotDataset`` (uses ``get_action_chunk``), a (T, D) array of actions,
    or an (N, H, D) array of chunks. ``num_chunks`` start frames are sampled without replacement (all of them when
    None or when the dataset is smaller). Padded steps past an episode's end are left out unless include_padded.
    Returns ``{"q01","q10","q50","q90","q99","min","max","mean","std": list[float] (D',), "count": int,
    "num_chunks": int, "horizon": int}``.
    """
    n, get = _chunk_reader(dataset, horizon)
    if n == 0:
        raise ValueError("compute_action_stats: empty dataset")
    rng = np.random.default_rng(seed)
    if num_chunks is None or num_chunks >= n:
        starts = np.arange(n)
    else:
        starts = np.sort(rng.choice(n, size=num_chunks, replace=False))
    chunks, masks = [], []
    for i in starts:
        a, m = get(int(i))
        chunks.append(_np(a))
        masks.append(_np(m).astype(bool))
    A = np.stack(chunks).astype(np.float64)  # (N, H, D)
    M = np.stack(masks)
    if pipeline_before_norm is not None and len(pipeline_before_norm):
        A = np.asarray(pipeline_before_norm.forward(A), dtype=np.float64)
    vals = A[M] if not include_padded else A.reshape(-1, A.shape[-1])
    if vals.shape[0] == 0:
        vals = A.reshape(-1, A.shape[-1])
    qs = np.quantile(vals, [0.01, 0.10, 0.50, 0.90, 0.99], axis=0)
    return {
        "q01": qs[0].tolist(), "q10": qs[1].tolist(), "q50": qs[2].tolist(), "q90": qs[3].tolist(),
        "q99": qs[4].tolist(),
        "min": vals.min(0).tolist(), "max": vals.max(0).tolist(),
        "mean": vals.mean(0).tolist(), "std": vals.std(0).tolist(),
        "count": int(vals.shape[0]), "num_chunks": int(len(starts)), "horizon": int(horizon),
    }
