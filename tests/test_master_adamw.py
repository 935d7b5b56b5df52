"""optimizer_impl=triton (train/master_adamw.py): AdamW on shard=none's fp32 masters, reading the module's bf16
gradients and writing its bf16 weights in one pass per tensor, does the default path's arithmetic (grads copied to
fp32, clipped, torch AdamW, copied back): the same masters, moments, steps and bf16 weights within fp32 rounding,
with and without gradient accumulation, with the clip engaged; its state loads into torch's AdamW; it is refused
where there are no masters; and the Triton kernel itself (run in Triton's CPU interpreter) equals its torch form."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from wamkit.core.errors import UserError
from wamkit.train.config import TrainConfig
from wamkit.train.master_adamw import MasterAdamW
from wamkit.train.optim import build_optimizer, clip_gradients
from wamkit.train.parallelize import setup_model

ROOT = Path(__file__).resolve().parents[1]
TRITON_SITE = ROOT / ".cache" / "triton-site"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 33)
        self.norm = nn.LayerNorm(33)
        self.b = nn.Linear(33, 5)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def _run(impl: str, steps: int = 4, ga: int = 1, clip: float = 0.05):
    torch.manual_seed(0)
    net = Net().float()
    model = setup_model(net, [], "cpu", 1, shard="none", mixed_precision="bf16")
    cfg = TrainConfig(lr=3e-2, weight_decay=0.1, optimizer_impl=impl)
    opt = build_optimizer(model.state, cfg, {"b.*": 2.0}, master=model.master)
    params = [p for p in model.state.parameters() if p.requires_grad]
    norms = []
    for s in range(steps):
        for k in range(ga):
            g = torch.Generator().manual_seed(100 * s + k)
            x = torch.randn(8, 12, generator=g)
            y = torch.randn(8, 5, generator=g)
            loss = ((net(x) - y) ** 2).mean()
            (loss / ga).backward()
            model.after_backward(k == 0, k == ga - 1)
        norms.append(float(clip_gradients(opt, params, clip)))
        opt.step()
        model.after_optimizer_step(opt)
    masters = {n: p.detach().clone() for n, p in model.state.named_parameters()}
    compute = {n: p.detach().clone() for n, p in net.named_parameters()}
    return masters, compute, opt, norms, model


@pytest.mark.parametrize("ga", [1, 2])
def test_triton_impl_matches_the_default_master_path(ga):
    ref_m, ref_c, ref_opt, ref_norms, _ = _run("foreach", ga=ga)
    m, c, opt, norms, model = _run("triton", ga=ga)
    assert isinstance(opt, MasterAdamW) and not isinstance(ref_opt, MasterAdamW)
    assert max(ref_norms) > 0.05          # the clip engaged on every step: its coefficient matters
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    for n in ref_m:
        torch.testing.assert_close(m[n], ref_m[n], rtol=1e-5, atol=1e-6, msg=n)
    for n in ref_c:
        assert c[n].dtype == torch.bfloat16
        torch.testing.assert_close(c[n].float(), ref_c[n].float(), rtol=1e-2, atol=1e-3, msg=n)
        # the bf16 weight is the master rounded: exactly what masters_to_model would write
        assert torch.equal(c[n], m[n].to(torch.bfloat16)), n
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"] or [
        {k: v for k, v in g.items() if k not in ("foreach",)} for g in sd["param_groups"]] == [
        {k: v for k, v in g.items() if k not in ("foreach",)} for g in ref_sd["param_groups"]]
    for i, st in ref_sd["state"].items():
        assert sd["state"][i].keys() == st.keys()
        assert float(sd["state"][i]["step"]) == float(st["step"]) == 4.0
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][i][k], st[k], rtol=1e-5, atol=1e-8)
    # after the step no gradient is left anywhere (the next backward starts clean)
    assert all(p.grad is None for p, _ in model.master.trainable_pairs())
    assert all(mm.grad is None for _, mm in model.master.trainable_pairs())


def test_without_the_clip_the_result_differs():
    """The comparison above could fail: a run whose clip does not engage ends elsewhere."""
    a, _, _, _, _ = _run("triton")
    b, _, _, _, _ = _run("triton", clip=1e9)
    assert any(not torch.allclose(a[n], b[n]) for n in a)


def test_its_state_loads_into_torch_adamw_and_back():
    _, _, opt, _, model = _run("triton", steps=2)
    other = build_optimizer(model.state, TrainConfig(lr=3e-2, weight_decay=0.1), {"b.*": 2.0})
    other.load_state_dict(opt.state_dict())
    again = build_optimizer(model.state, TrainConfig(lr=3e-2, weight_decay=0.1, optimizer_impl="triton"),
                            {"b.*": 2.0}, master=model.master)
    again.load_state_dict(other.state_dict())
    assert set(again.state_dict()["state"]) == set(opt.state_dict()["state"])


def test_refused_without_master_weights():
    net = Net()
    model = setup_model(net, [], "cpu", 1, shard="none", mixed_precision="fp32")
    assert model.master is None
    with pytest.raises(UserError, match="optimizer_impl=triton"):
        build_optimizer(model.state, TrainConfig(optimizer_impl="triton"), {}, master=model.master)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from wamkit.train import master_adamw as M
    assert M.kernel_usable(torch.device("cpu")), "the interpreter should make the kernel usable"
    g0 = torch.Generator().manual_seed(0)
    for n in (1, 777, M.BLOCK + 3):
        for gdt in (torch.bfloat16, torch.float32):
            g = torch.randn(n, generator=g0).to(gdt)
            w = torch.randn(n, generator=g0)
            m = torch.randn(n, generator=g0) * 0.1
            v = torch.rand(n, generator=g0) * 0.01
            p = torch.empty(n, dtype=torch.bfloat16)
            coef = torch.tensor(0.37)
            args = (0.9, 0.95, 1e-8, 1 - 1e-3 * 0.1, 1e-3 / (1 - 0.9 ** 3), (1 - 0.95 ** 3) ** 0.5)
            ref = [t.clone() for t in (w, m, v, p)]
            M._step_torch(g, *ref, coef, *args)
            M._master_adamw_kernel[(M.triton.cdiv(n, M.BLOCK),)](g, w, m, v, p, coef, n, *args, BLOCK_SIZE=M.BLOCK)
            for got, want, name in zip((w, m, v, p), ref, "wmvp"):
                torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=1e-7, msg=f"{name} n={n}")
            assert torch.equal(p, w.to(torch.bfloat16))
    # special values through the bf16 rounding: infinities, the largest float (rounds to inf, as torch's), NaN
    w = torch.tensor([float("inf"), -float("inf"), 3.4e38, -1.0e-40, 0.0, float("nan")])
    z = torch.zeros(6)
    p = torch.empty(6, dtype=torch.bfloat16)
    M._master_adamw_kernel[(1,)](z.to(torch.bfloat16), w, z.clone(), z.clone(), p, torch.tensor(1.0), 6,
                                 0.9, 0.95, 1e-8, 1.0, 1e-3, 1.0, BLOCK_SIZE=M.BLOCK)
    want = w.to(torch.bfloat16)
    assert torch.equal(p[:5], want[:5]) and torch.isnan(p[5]), (p, want)
    print("KERNEL_OK")
""")


@pytest.mark.skipif(not (TRITON_SITE / "triton").is_dir(),
                    reason="needs Triton for its CPU interpreter in .cache/triton-site (make test installs it)")
def test_triton_kernel_equals_its_torch_form_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(TRITON_SITE), str(ROOT / "src")])}
    r = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "KERNEL_OK" in r.stdout, r.stdout + r.stderr


def test_trainer_run_with_triton_matches_and_resumes_across_impls(tmp_path):
    """`wamkit train` in-process, shard=none + bf16: optimizer_impl=triton gives the default path's losses (fp32
    rounding apart, bf16 compute), and a run stopped at step 3 under one implementation resumes under the other."""
    from test_train_support import BASE_ARGS, losses
    from wamkit.core.config import load_config
    from wamkit.train.trainer import train

    def cfg(out, *args):
        return load_config(TrainConfig, None, [*BASE_ARGS, f"out={out}", "progress=false", "steps=6",
                                               "batch_size=8", "save_every=0", "shard=none",
                                               "mixed_precision=bf16", *args])

    train(cfg(tmp_path / "ref", "optimizer_impl=foreach"))
    train(cfg(tmp_path / "tri", "optimizer_impl=triton"))
    a, b = losses(tmp_path / "ref"), losses(tmp_path / "tri")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert a[1] == b[1]                                  # same weights, same batch: the first loss is identical
    for s in range(2, 7):            # equal here in fact; without the clip step 6 would be 4.6% off
        assert b[s] == pytest.approx(a[s], rel=1e-4), s
    for first, then in (("foreach", "triton"), ("triton", "foreach")):
        part = tmp_path / f"{first}-{then}"
        train(cfg(part, f"optimizer_impl={first}", "stop_at=3"))
        train(cfg(part, f"optimizer_impl={then}", "resume=true"))
        c = losses(part)
        assert sorted(c) == list(range(1, 7))
        for s in range(1, 7):
            assert c[s] == pytest.approx(a[s], rel=1e-4), (first, then, s)
