"""Shared pieces of the training tests (no tests here): a small trainable policy implementing the trainer-facing
Policy contract, a synthetic data source (items shaped like wamkit.data.samples.TrainingSamples'), and a helper to run `wamkit train` under torchrun.

Used in-process and by torchrun workers (`policy=test_train_support:TinyPolicy`, `dataset=test_train_support:
synthetic_source`, with tests/ on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn

from wamkit.data.transforms import ActionPipeline
from wamkit.policies.base import ActionSpec, InputSpec, Policy, PolicySpec

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    def __init__(self, in_dim: int, width: int, depth: int, out_dim: int):
        super().__init__()
        self.inp = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, out_dim)
        self.register_buffer("in_scale", torch.full((in_dim,), 2.0))

    def forward(self, x):
        h = self.inp(x * self.in_scale.to(x.dtype))   # bf16 compute (shard=none masters): the buffer stays fp32
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def features(images: dict, state) -> torch.Tensor:
    img = torch.as_tensor(np.asarray(images["image"])).float() / 255.0       # (B,H,W,3)
    f = [img.mean(dim=(1, 2)), img[:, ::2, ::2].std(dim=(1, 2))]
    if state is not None:
        f.append(torch.as_tensor(np.asarray(state), dtype=torch.float32))
    return torch.cat(f, -1)


class TinyPolicy(Policy):
    """A real (small) trainable policy: image statistics + state -> an MLP -> an action chunk (regression).

    noise > 0 adds torch-RNG noise to the targets (exercises RNG state in checkpoints, like flow matching does)."""

    def __init__(self, width: int = 32, depth: int = 2, horizon: int = 4, action_dim: int = 7, state_dim: int = 3,
                 noise: float = 0.0, action_pipeline=None, trainable_patterns: Sequence[str] = (),
                 device: str = "cpu"):
        self.horizon, self.action_dim, self.state_dim, self.noise = horizon, action_dim, state_dim, float(noise)
        self.width, self.depth = width, depth
        self.device = torch.device(device)
        self.action_pipeline = (action_pipeline if isinstance(action_pipeline, ActionPipeline)
                                else ActionPipeline.from_dict(action_pipeline) if action_pipeline
                                else ActionPipeline([]))
        torch.manual_seed(0)
        self.net = TinyNet(6 + state_dim, width, depth, horizon * action_dim).to(self.device)
        self.trainable_patterns = list(trainable_patterns)
        self.spec = PolicySpec(name="tiny-test", input=InputSpec(cameras=("image",), state_dim=state_dim),
                               action=ActionSpec(dim=action_dim, horizon=horizon, representation="env"),
                               trainable=True)

    @property
    def module(self):
        return self.net

    def export_config(self):
        return {"width": self.width, "depth": self.depth, "horizon": self.horizon, "action_dim": self.action_dim,
                "state_dim": self.state_dim}

    def fsdp_units(self):
        return [*self.net.blocks, self.net]

    def lr_multipliers(self):
        return {"inp.*": 5.0, "out.*": 5.0}

    def sft_loss(self, batch):
        x = features(batch["images"], batch.get("state")).to(self.device)
        pred = self.net(x).view(-1, self.horizon, self.action_dim)
        target = batch["actions"].to(self.device)
        if self.noise:
            target = target + self.noise * torch.randn_like(target)
        err = ((pred - target) ** 2).mean(-1)
        mask = batch["action_mask"].to(self.device).float()
        loss = (err * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"loss": float(loss.detach()), "pred_abs": float(pred.detach().abs().mean())}

    @torch.no_grad()
    def predict(self, observations, seeds):
        imgs = {"image": np.stack([o.images["image"] for o in observations])}
        st = np.stack([o.state for o in observations]) if self.state_dim else None
        pred = self.net(features(imgs, st).to(self.device)).view(-1, self.horizon, self.action_dim)
        return np.asarray(self.action_pipeline.inverse(pred.cpu().numpy()), np.float32)


# ------------------------------------------------------------------------------------------------ synthetic data

class SyntheticSamples(torch.utils.data.Dataset):
    """Sample i: an 8x8 image and a state derived from i; the action chunk is a fixed function of them."""

    def __init__(self, n: int, horizon: int, state_dim: int, pipeline: ActionPipeline | None):
        self.n, self.horizon, self.state_dim, self.pipeline = n, horizon, state_dim, pipeline
        g = np.random.default_rng(123)
        self.W = g.normal(size=(6 + state_dim, horizon * 7)).astype(np.float32)

    def __len__(self):
        return self.n

    def raw(self, i):
        g = np.random.default_rng(i)
        img = g.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        state = g.normal(size=self.state_dim).astype(np.float32)
        f = features({"image": img[None]}, state[None]).numpy()[0]
        act = (np.tanh(f @ self.W) * 0.5).reshape(self.horizon, 7).astype(np.float32)
        return img, state, act

    def get_action_chunk(self, i, horizon):
        return self.raw(i)[2][:horizon], np.ones(horizon, bool)

    def __getitem__(self, i):
        img, state, act = self.raw(int(i))
        if self.pipeline is not None:
            act = np.asarray(self.pipeline.forward(act), np.float32)
        return {"images": {"image": torch.from_numpy(img)}, "state": torch.from_numpy(state), "task": "synthetic",
                "actions": torch.from_numpy(act), "action_mask": torch.ones(self.horizon, dtype=torch.bool),
                "index": int(i)}


def synthetic_source(cfg, policy):
    from wamkit.data.samples import collate
    from wamkit.train.data import DataSource, default_sampler

    n = int(os.environ.get("WAMKIT_TEST_SAMPLES", "96"))
    fps = float(os.environ.get("WAMKIT_TEST_FPS", "10"))
    horizon = policy.spec.action.horizon
    raw = SyntheticSamples(n, horizon, policy.spec.input.state_dim, None)
    return DataSource(fps=fps, stats_dataset=raw,
                      make_samples=lambda pipe: SyntheticSamples(n, horizon, policy.spec.input.state_dim, pipe),
                      collate=collate, make_sampler=default_sampler, description=f"synthetic({n})")


# ------------------------------------------------------------------------------------------------ running

BASE_ARGS = ["policy=test_train_support:TinyPolicy", "dataset=test_train_support:synthetic_source", "fps=10",
             "num_workers=0", "progress=false", "log_every=1", "warmup=3", "lr=3e-3", "seed=1"]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT / "src"), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    return e


def run_train(args: list[str], nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """`wamkit train ARGS` in a fresh process (torchrun with nproc ranks when nproc > 1)."""
    cmd = [sys.executable, "-m", "wamkit.cli.main", "train", *BASE_ARGS, *args, f"nproc={nproc}"]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    if p.returncode != 0:
        raise AssertionError(f"train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def cli_fails(capsys, argv: list[str], *must_name: str) -> str:
    """`wamkit ARGV` in-process: exit 2 and one line naming each of must_name."""
    from wamkit.cli.main import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for s in must_name:
        assert s in err, (s, err)
    return err


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (Path(out) / "train_log.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in rows}


# ------------------------------------------------------------------------------------------------ meta-device build

def check_meta_init(policy_args: dict) -> int:
    """The trainer's build for large models (meta device -> parallelize -> init_weights on each rank) gives every
    rank the weights and buffers of a materialized CPU build, bit for bit. Runs on one rank in-process, or on N
    under torchrun (`python tests/test_train_support.py meta-init`). Returns how many tensors were compared."""
    from wamkit.train.dist import close_distributed, init_distributed
    from wamkit.train.parallelize import parallelize
    from wamkit.train.trainer import build_for_training, build_policy

    info = init_distributed("cpu")
    try:
        pol, deferred = build_for_training("wam-ref", dict(policy_args), info.device)
        assert deferred and all(p.is_meta for p in pol.module.parameters())
        pol.module.float()
        parallelize(pol.module, list(pol.fsdp_units()), "cpu", info.world_size, mixed_precision="fp32")
        pol.init_weights(info.device)
        ref = build_policy("wam-ref", dict(policy_args), device="cpu").module.float()
        want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
        got = {**dict(pol.module.named_parameters()), **dict(pol.module.named_buffers())}
        assert sorted(got) == sorted(want)
        for k, v in got.items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert torch.equal(full, want[k]), k
        assert [n for n, p in got.items() if getattr(p, "requires_grad", False)] == \
            [n for n, p in want.items() if getattr(p, "requires_grad", False)]
        return len(got)
    finally:
        close_distributed(info)


if __name__ == "__main__" and sys.argv[1:2] == ["meta-init"]:
    n = check_meta_init({"size": "tiny", "state_dim": 4})
    print(f"meta-init ok: {n} tensors")
