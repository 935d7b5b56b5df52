"""The reference flow on a CPU: `wamkit eval` of Cosmos3 (the adapter's pre/post-processing in the evaluation
process) behind `wamkit serve` standing in for SGLang (`cosmos3-standin`, here around an untrained but deterministic
`wam-ref` tiny that reads both cameras and the task), on real LIBERO. Per-episode results, and the hash of every
action chunk each episode executed, are identical for serial, (B, P) pipelines and auto; the shipped config runs as
the README says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from wamkit.core.config import load_config
from wamkit.eval.config import EvalConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "libero_cosmos3_sglang.yaml"
pytestmark = [pytest.mark.slow, pytest.mark.libero]


def _stats(tmp_path: Path) -> Path:
    p = tmp_path / "stats.json"
    p.write_text(json.dumps({"q01": [-0.9, -0.8, -0.7, -1, -1, -1, -1, -1, -1, 0.0],
                             "q99": [0.9, 0.8, 0.7, 1, 1, 1, 1, 1, 1, 1.0]}))
    return p


def _outcomes(out: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    return sorted((r["key"], r["success"], r["steps"], r["actions_digest"]) for r in rows)


def test_cosmos3_schedule_invariance_through_the_standin(tmp_path):
    pytest.importorskip("libero")
    from wamkit.eval.runner import run_eval

    stats = _stats(tmp_path)
    base = ["env=libero", "suite=libero_object", "tasks=0", "trials=2", "image_size=64", "max_steps=32",
            "policy=cosmos3", f"policy_args.action_stats={stats}", "policy_args.seed=null", "inference=server",
            "server.policy=cosmos3-standin", "server.policy_args.inner=wam-ref",
            "server.policy_args.inner_args.size=tiny", "server.policy_args.inner_args.num_inference_steps=2",
            "server.policy_args.inner_args.image_size=64", "progress=false"]
    views = []
    for i, extra in enumerate((["mode=serial"], ["mode=pipelines", "num_envs=2", "request_size=1", "pipelines=2"],
                               ["mode=pipelines", "num_envs=2", "request_size=2", "pipelines=1"],
                               ["mode=auto", "num_envs=2"])):
        s = run_eval(load_config(EvalConfig, None, base + extra + [f"out={tmp_path / str(i)}"]))
        assert s["config"]["server"]["protocol"] == "auto" and s["scheduler"]["requests"] > 0
        views.append(_outcomes(tmp_path / str(i)))
    assert views[0] == views[1] == views[2] == views[3]
    assert len(views[0]) == 2 and len({v[3] for v in views[0]}) == 2     # two episodes, two different trajectories


def test_shipped_config_runs_against_the_standin(tmp_path):
    """`wamkit eval configs/libero_cosmos3_sglang.yaml` with the CPU overrides of docs/evaluation.md: the reference's
    shape (SGLang request form, auto, pipelined) on a tiny plan; exit 0, a summary naming the protocol."""
    pytest.importorskip("libero")
    stats = _stats(tmp_path)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "wamkit.cli.main", "eval", str(CONFIG), "server.launch=wamkit",
                        "server.policy=cosmos3-standin", "server.replicas=1", "server.gpus=null",
                        f"policy_args.action_stats={stats}", "tasks=0", "trials=1", "num_envs=2", "max_steps=16",
                        "image_size=64", f"out={out}", "progress=false"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["episodes"] == 1 and s["config"]["policy"] == "cosmos3" and s["config"]["mode"] == "auto"
    assert s["config"]["server"]["protocol"] == "sglang" and s["scheduler"]["requests"] >= 1


def _real_sglang() -> str:
    import importlib.util
    import os

    if importlib.util.find_spec("sglang") is None:
        return "needs sglang installed (a CUDA machine: pip install sglang)"
    try:
        import torch
        if not torch.cuda.is_available():
            return "needs a CUDA GPU for sglang serve"
    except Exception as e:  # pragma: no cover
        return f"torch unavailable: {e}"
    if not (os.environ.get("WAMKIT_COSMOS3_MODEL") and os.environ.get("WAMKIT_COSMOS3_STATS")):
        return ("set WAMKIT_COSMOS3_MODEL (a diffusers-format Cosmos3 LIBERO checkpoint) and WAMKIT_COSMOS3_STATS "
                "(its action stats JSON)")
    return ""


@pytest.mark.gpu
@pytest.mark.skipif(bool(_real_sglang()), reason=_real_sglang() or "real sglang")
def test_shipped_config_against_real_sglang(tmp_path):
    """The same command on a GPU machine: `sglang serve` started by wamkit (one per GPU of the machine)."""
    import os

    import torch

    out = tmp_path / "run"
    n = torch.cuda.device_count()
    r = subprocess.run([sys.executable, "-m", "wamkit.cli.main", "eval", str(CONFIG),
                        f"server.sglang.model_path={os.environ['WAMKIT_COSMOS3_MODEL']}",
                        f"policy_args.action_stats={os.environ['WAMKIT_COSMOS3_STATS']}", f"server.replicas={n}",
                        f"server.gpus={','.join(map(str, range(n)))}", "tasks=0", "trials=2", "num_envs=4",
                        f"out={out}", "progress=false"], capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["episodes"] == 2 and s["scheduler"]["requests"] >= 1
