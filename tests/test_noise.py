"""What a user's terminal should not show: robosuite's private-macro warnings, MetaWorld's expert-gain UserWarning,
torch's non-writable-array warning (each checked where it used to come from)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}


@pytest.mark.libero
def test_robosuite_import_through_wamkit_is_quiet():
    pytest.importorskip("robosuite")
    code = "import wamkit.envs.libero, robosuite, robosuite.macros; print(robosuite.macros.SIMULATION_TIMESTEP)"
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "macro" not in p.stderr.lower(), p.stderr
    assert float(p.stdout.strip()) > 0                       # robosuite's own defaults still apply


@pytest.mark.metaworld
def test_metaworld_expert_gain_warning_is_filtered():
    pytest.importorskip("metaworld")
    code = ("import warnings; import wamkit.policies.metaworld_expert; "
            "from metaworld.policies.policy import move; import numpy as np; "
            "move(np.zeros(3), np.ones(3) * 10, p=10.0); print('moved')")
    p = subprocess.run([sys.executable, "-W", "default", "-c", code], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "moved" in p.stdout, p.stderr
    assert "Constant(s) may be too high" not in p.stderr, p.stderr


def test_wam_ref_reads_read_only_images_without_a_torch_warning():
    pytest.importorskip("transformers")
    from wamkit.policies import make_policy

    pol = make_policy("wam-ref", size="tiny", cameras=["image"], image_size=32, action_dim=4, horizon=4)
    img = np.frombuffer(bytes(32 * 32 * 3), np.uint8).reshape(32, 32, 3)      # as decoded from the wire
    assert not img.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pol.inputs.pixel_values([img])
