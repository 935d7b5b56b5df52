"""Pins the LIBERO conventions (libero_conventions) and the MetaWorld instruction rule. No simulator is built."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from wamkit.envs import libero_conventions as C


def test_suites_and_max_steps():
    assert C.SUITE_MAX_STEPS == {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300,
                                 "libero_10": 520, "libero_90": 400}
    assert C.suite_max_steps("libero_10") == 520
    with pytest.raises(Exception, match="libero_spatial"):
        C.suite_max_steps("libero_100")


def test_wait_steps_dummy_action_init_states_cameras():
    assert C.NUM_WAIT_STEPS == 10
    np.testing.assert_array_equal(C.dummy_action(), [0, 0, 0, 0, 0, 0, -1])
    assert C.NUM_INIT_STATES == 50
    assert C.CAMERAS["image"] == ("agentview", "agentview_image")
    assert C.CAMERAS["wrist_image"] == ("robot0_eye_in_hand", "robot0_eye_in_hand_image")
    assert (C.ACTION_DIM, C.STATE_DIM, C.CONTROL_HZ) == (7, 8, 20.0)


def test_flip_is_180_degree_rotation():
    img = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    out = C.flip_image(img)
    assert out.flags["C_CONTIGUOUS"] and out.shape == img.shape
    np.testing.assert_array_equal(out, np.rot90(img, 2, axes=(0, 1)))
    assert out[0, 0].tolist() == img[-1, -1].tolist()


def _canonical(q):
    """The robosuite/LIBERO formula, written out independently."""
    w = np.clip(q[3], -1, 1)
    s = np.sqrt(1 - w * w)
    return np.zeros(3) if s == 0 else q[:3] * 2 * np.arccos(w) / s


@pytest.mark.parametrize("seed", range(5))
def test_quat2axisangle_matches_scipy_for_positive_w(seed):
    q = Rotation.random(50, random_state=seed).as_quat()  # xyzw
    q[q[:, 3] < 0] *= -1
    for qi in q:
        np.testing.assert_allclose(C.quat2axisangle(qi), Rotation.from_quat(qi).as_rotvec(), atol=1e-9)
        # the same formula; numpy's SIMD arccos and libm's acos may differ in the last bit on some CPUs (AVX-512)
        np.testing.assert_allclose(C.quat2axisangle(qi), _canonical(qi), rtol=0, atol=4e-15)


def test_quat2axisangle_negative_w_keeps_canonical_sign():
    q = Rotation.from_rotvec([0.3, -0.2, 0.5]).as_quat()
    neg = -q  # same rotation, w < 0
    aa = C.quat2axisangle(neg)
    # canonical semantics: angle 2*acos(w) in (pi, 2pi], not scipy's shortest rotvec ...
    assert np.linalg.norm(aa) > np.pi
    np.testing.assert_allclose(aa, _canonical(neg), atol=1e-12)
    # ... but the same rotation
    np.testing.assert_allclose(Rotation.from_rotvec(aa).as_matrix(), Rotation.from_quat(q).as_matrix(), atol=1e-9)


def test_quat2axisangle_edge_cases_no_nan():
    # identity and w past 1 (unnormalized): zeros
    np.testing.assert_array_equal(C.quat2axisangle([0, 0, 0, 1.0]), np.zeros(3))
    np.testing.assert_array_equal(C.quat2axisangle([1e-9, 0, 0, 1.0 + 1e-7]), np.zeros(3))
    np.testing.assert_array_equal(C.quat2axisangle([0, 0, 0, -1.0 - 1e-7]), np.zeros(3))
    # near zero angle: finite, matches scipy
    tiny = Rotation.from_rotvec([1e-7, -2e-7, 3e-7]).as_quat()
    np.testing.assert_allclose(C.quat2axisangle(tiny), [1e-7, -2e-7, 3e-7], atol=1e-12)
    # angle exactly pi (w = 0) and near pi from both sides
    for w in (0.0, 1e-9, -1e-9):
        v = np.array([0.0, 0.6, 0.8]) * np.sqrt(1 - w * w)
        aa = C.quat2axisangle([*v, w])
        assert np.all(np.isfinite(aa))
        np.testing.assert_allclose(np.linalg.norm(aa), 2 * np.arccos(w), atol=1e-9)
        np.testing.assert_allclose(Rotation.from_rotvec(aa).as_matrix(),
                                   Rotation.from_quat([*v, w]).as_matrix(), atol=1e-7)


def test_state_layout():
    s = C.libero_state([1, 2, 3], [0, 0, 0, 1], [0.04, -0.04])
    assert s.dtype == np.float32 and s.shape == (8,)
    np.testing.assert_allclose(s, [1, 2, 3, 0, 0, 0, 0.04, -0.04], rtol=1e-6)
    q = Rotation.from_rotvec([0, 0, 0.5]).as_quat()
    s = C.state_from_obs({"robot0_eef_pos": np.zeros(3), "robot0_eef_quat": q, "robot0_gripper_qpos": np.ones(2)})
    np.testing.assert_allclose(s[3:6], [0, 0, 0.5], atol=1e-6)


def test_metaworld_instruction_round_trip():
    pytest.importorskip("metaworld")
    from wamkit.envs.metaworld import all_task_names, task_instruction
    from wamkit.policies.metaworld_expert import task_from_instruction

    assert task_instruction("pick-place-v3") == "pick place"
    assert task_from_instruction("pick place") == "pick-place-v3"
    names = all_task_names()
    assert len(names) == 50
    for n in names:
        assert task_from_instruction(task_instruction(n)) == n
    instr = [task_instruction(n) for n in names]
    assert len(set(instr)) == len(instr)
