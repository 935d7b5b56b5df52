"""Pins the action conventions of wamkit.data.transforms (rot6d layout, gripper sign, quantile normalization)."""

import json

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from wamkit.data.transforms import (
    ActionPipeline, GripperStep, QuantileNormalizer, QuantileNormalizeStep, Rot6dStep, actions7_to_10,
    actions10_to_7, axis_angle_to_rot6d, compute_action_stats, gripper_01_to_env, gripper_env_to_01,
    rot6d_to_axis_angle,
)


def _rotvecs(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    generic = Rotation.random(n, random_state=seed).as_rotvec()
    axis = rng.normal(size=(500, 3))
    axis /= np.linalg.norm(axis, axis=1, keepdims=True)
    near_pi = axis * (np.pi - 10 ** rng.uniform(-12, -1, size=500))[:, None]
    exactly_pi = np.array([[np.pi, 0, 0], [0, np.pi, 0], [0, 0, np.pi], [np.pi / np.sqrt(2), np.pi / np.sqrt(2), 0]])
    tiny = np.array([[0.0, 0, 0], [1e-9, 0, 0], [0, -3e-7, 1e-8]])
    return np.concatenate([generic, near_pi, exactly_pi, tiny])


def test_rot6d_layout_matches_scipy_columns():
    aa = _rotvecs()
    R = Rotation.from_rotvec(aa).as_matrix()
    r6 = axis_angle_to_rot6d(aa)
    expected = np.stack([R[:, 0, 0], R[:, 1, 0], R[:, 2, 0], R[:, 0, 1], R[:, 1, 1], R[:, 2, 1]], -1)
    np.testing.assert_allclose(r6, expected, atol=1e-12)


def test_rot6d_round_trip_matches_scipy_including_near_pi():
    aa = _rotvecs()
    back = rot6d_to_axis_angle(axis_angle_to_rot6d(aa))
    np.testing.assert_allclose(Rotation.from_rotvec(back).as_matrix(), Rotation.from_rotvec(aa).as_matrix(),
                               atol=1e-9)
    assert np.all(np.linalg.norm(back, axis=-1) <= np.pi + 1e-9)
    away = np.linalg.norm(aa, axis=-1) < np.pi - 1e-3
    np.testing.assert_allclose(back[away], aa[away], atol=1e-9)
    # scipy's own matrix -> rotvec agrees wherever the answer is unique
    ref = Rotation.from_matrix(Rotation.from_rotvec(aa[away]).as_matrix()).as_rotvec()
    np.testing.assert_allclose(back[away], ref, atol=1e-9)


def test_rot6d_projection_handles_noisy_input():
    aa = _rotvecs(200, seed=3)
    r6 = axis_angle_to_rot6d(aa) + np.random.default_rng(1).normal(scale=1e-3, size=(len(aa), 6))
    back = rot6d_to_axis_angle(r6)
    err = (Rotation.from_rotvec(back) * Rotation.from_rotvec(aa).inv()).magnitude()
    assert err.max() < 1e-2


def test_actions_7_10_round_trip_and_dtype():
    rng = np.random.default_rng(0)
    a7 = np.concatenate([rng.normal(size=(4, 16, 3)), _rotvecs(64).reshape(-1, 3)[:64].reshape(4, 16, 3),
                         rng.uniform(size=(4, 16, 1))], -1).astype(np.float32)
    a10 = actions7_to_10(a7)
    assert a10.shape == (4, 16, 10) and a10.dtype == np.float32
    np.testing.assert_array_equal(a10[..., :3], a7[..., :3])
    np.testing.assert_array_equal(a10[..., 9], a7[..., 6])
    np.testing.assert_allclose(actions10_to_7(a10), a7, atol=1e-5)


def test_torch_tensors_accepted():
    torch = pytest.importorskip("torch")
    a7 = torch.zeros(2, 7)
    out = actions7_to_10(a7)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out[0, 3:9], [1, 0, 0, 0, 1, 0])


def test_gripper_convention():
    np.testing.assert_allclose(gripper_01_to_env(np.array([1.0, 0.0, 0.5])), [-1.0, 1.0, 0.0])  # 1 = open -> -1
    np.testing.assert_allclose(gripper_env_to_01(gripper_01_to_env(np.array([0.2, 0.9]))), [0.2, 0.9])


def test_quantile_normalizer_maps_quantiles_to_unit_range():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5000, 10)) * rng.uniform(0.1, 5, size=10) + rng.normal(size=10)
    q01, q99 = np.quantile(x, 0.01, 0), np.quantile(x, 0.99, 0)
    n = QuantileNormalizer(q01, q99)
    np.testing.assert_allclose(n.normalize(q01[None]), -1.0, atol=1e-12)
    np.testing.assert_allclose(n.normalize(q99[None]), 1.0, atol=1e-12)
    np.testing.assert_allclose(n.denormalize(n.normalize(x)), x, atol=1e-9)
    assert np.abs(QuantileNormalizer(q01, q99, clip=True).normalize(x)).max() <= 1.0
    # constant channel: range clamped to eps, no division by zero
    c = QuantileNormalizer([0.5], [0.5])
    assert np.isfinite(c.normalize(np.array([[0.5], [0.6]]))).all()
    n2 = QuantileNormalizer.from_dict(json.loads(json.dumps(n.to_dict())))
    np.testing.assert_allclose(n2.normalize(x), n.normalize(x))


def test_pipeline_forward_inverse_save_load(tmp_path):
    rng = np.random.default_rng(0)
    a7 = np.concatenate([rng.normal(size=(100, 3)), _rotvecs(100)[:100], np.sign(rng.normal(size=(100, 1)))], -1)
    stats = compute_action_stats(a7, horizon=8, pipeline_before_norm=ActionPipeline([Rot6dStep(), GripperStep()]))
    pipe = ActionPipeline([Rot6dStep(), GripperStep(), QuantileNormalizeStep(stats["q01"], stats["q99"])])
    assert pipe.out_dim(7) == 10
    m = pipe.forward(a7)
    assert m.shape == (100, 10)
    assert set(np.unique(pipe.steps[1].forward(a7)[:, -1])) <= {0.0, 1.0}
    pipe.save(tmp_path / "action_pipeline.json")
    loaded = ActionPipeline.load(tmp_path / "action_pipeline.json")
    np.testing.assert_allclose(loaded.forward(a7), m)
    back = loaded.inverse(m)
    np.testing.assert_allclose(Rotation.from_rotvec(back[:, 3:6]).as_matrix(),
                               Rotation.from_rotvec(a7[:, 3:6]).as_matrix(), atol=1e-9)
    np.testing.assert_allclose(back[:, [0, 1, 2, 6]], a7[:, [0, 1, 2, 6]], atol=1e-9)


def test_gripper_step_inverse_only():
    s = GripperStep(on_forward=False)
    a = np.array([[0, 0, 0, 0, 0, 0, 1.0]])
    np.testing.assert_array_equal(s.forward(a), a)
    assert s.inverse(a)[0, -1] == -1.0  # model [0,1] open -> env -1 open


def test_compute_action_stats_quantiles():
    x = np.arange(1000, dtype=np.float64)[:, None] * np.ones((1, 3))
    s = compute_action_stats(x, horizon=1, num_chunks=None)
    assert s["count"] == 1000
    np.testing.assert_allclose(s["q01"], np.quantile(x[:, 0], 0.01))
    np.testing.assert_allclose(s["q99"], np.quantile(x[:, 0], 0.99))
    assert s["min"] == [0.0] * 3 and s["max"] == [999.0] * 3
