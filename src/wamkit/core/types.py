"""Value types passed between layers: observations in, action chunks out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Observation:
    """What a policy sees at one decision step.

    images: camera name -> uint8 array (H, W, 3), already in the orientation policies are trained on.
    state:  proprio / low-dimensional state (float32, 1-D) or None.
    task:   natural-language task text.
    """

    images: dict[str, np.ndarray]
    state: np.ndarray | None
    task: str

    def nbytes(self) -> int:
        n = sum(int(a.nbytes) for a in self.images.values())
        return n + (0 if self.state is None else int(self.state.nbytes))


@dataclass
class ChunkResult:
    """What an env returns after executing (part of) an action chunk.

    obs is None when the episode is done (nothing left to observe) unless the caller asked for it.
    steps: env steps executed by this call (< len(chunk) when the episode ended inside the chunk).
    """

    obs: Observation | None
    success: bool
    done: bool
    steps: int
    episode_steps: int
    frames: list[np.ndarray] = field(default_factory=list)  # per-step frames when recording video
    worker_s: float | None = None  # seconds the env's own process spent on the call (stepping, rendering, packing
                                   # the reply): what the caller's span adds beyond it is transport and its own wait
    worker_cpu_s: float | None = None     # CPU seconds the env's process used in execute (a GPU wait that spins,
                                          # e.g. an EGL render behind the model's kernels, counts here)
    worker_render_s: float | None = None  # seconds of execute spent rendering cameras (envs that count it: LIBERO)
