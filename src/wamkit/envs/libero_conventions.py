"""LIBERO evaluation conventions: each one lives here, once, and is pinned by tests/test_envs_conventions.py.

These are the conventions every published LIBERO evaluation uses (OpenVLA / openpi LIBERO eval scripts). Getting any
of them wrong silently changes success rates by 5-40 points, so nothing else in wamkit re-derives them.
"""

from __future__ import annotations

import math

import numpy as np

# Suites and their per-episode policy step budgets (not counting wait steps).
SUITE_MAX_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
SUITES: tuple[str, ...] = tuple(SUITE_MAX_STEPS)

# At the start of every episode the env is stepped this many times with the dummy action so objects settle.
NUM_WAIT_STEPS = 10
DUMMY_ACTION: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0)  # no motion, gripper open

# Fixed init states per task (the standard protocol: one trial per init state).
NUM_INIT_STATES = 50

ACTION_DIM = 7          # OSC_POSE delta: 3 translation, 3 axis-angle rotation, 1 gripper (-1 open, +1 close)
STATE_DIM = 8           # eef pos (3) + eef axis-angle (3) + gripper qpos (2)
CONTROL_HZ = 20.0

# robosuite camera name -> (robosuite observation key, wamkit Observation.images key)
CAMERAS: dict[str, tuple[str, str]] = {
    "image": ("agentview", "agentview_image"),
    "wrist_image": ("robot0_eye_in_hand", "robot0_eye_in_hand_image"),
}


def suite_max_steps(suite: str) -> int:
    if suite not in SUITE_MAX_STEPS:
        from wamkit.core.errors import unknown_choice

        raise unknown_choice("LIBERO suite", suite, SUITES)
    return SUITE_MAX_STEPS[suite]


def dummy_action() -> np.ndarray:
    return np.asarray(DUMMY_ACTION, dtype=np.float64)


def flip_image(img: np.ndarray) -> np.ndarray:
    """robosuite renders upside down (OpenGL convention); every LIBERO evaluation rotates both cameras by 180
    degrees: `img[::-1, ::-1]`. Returns a contiguous copy."""
    return np.ascontiguousarray(img[::-1, ::-1])


def quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """Axis-angle (3,) of a quaternion in xyzw order, with the canonical robosuite/LIBERO semantics.

    angle = 2 * acos(w) with w clipped to [-1, 1] (so the angle is in [0, 2*pi]; a negative w gives an angle above pi,
    the same rotation as scipy's rotvec but a different vector: training data used this form, so do we);
    the identity (sin(angle/2) == 0) maps to zeros. No NaN for w at or slightly past +-1 or near 0 (angle near pi).
    """
    q = np.asarray(quat, dtype=np.float64)
    w = min(max(float(q[3]), -1.0), 1.0)
    den = math.sqrt(1.0 - w * w)
    if den == 0.0:
        return np.zeros(3, dtype=np.float64)
    return (q[:3] * 2.0 * math.acos(w)) / den


def libero_state(eef_pos: np.ndarray, eef_quat_xyzw: np.ndarray, gripper_qpos: np.ndarray) -> np.ndarray:
    """The 8-D state: eef position (3) + axis-angle of the eef quaternion (3) + gripper joint positions (2)."""
    return np.concatenate([np.asarray(eef_pos, np.float64), quat2axisangle(eef_quat_xyzw),
                           np.asarray(gripper_qpos, np.float64)]).astype(np.float32)


def state_from_obs(obs: dict) -> np.ndarray:
    """8-D state from a robosuite observation dict."""
    return libero_state(obs["robot0_eef_pos"], obs["robot0_eef_quat"], obs["robot0_gripper_qpos"])
