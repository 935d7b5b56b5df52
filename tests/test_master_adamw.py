"""optimizer_impl=triton (train/master_adamw.py): AdamW on shard=none's fp32 masters, reading the module's bf16
gradients and writing its bf16 weights in one pass per tensor, does the default path's arithmetic (grads copied to
fp32, clipped, torch AdamW, copied back): the same masters, moments, steps and bf16 weights within fp32 rounding,
with and without gradient accumulation, with the clip engaged; its state loads into torch's AdamW; it is refused
where there are no masters; and the Triton kernel itself (run in Triton's CPU interpreter) equals its torch form."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn as nn

from triton_interpreter import ROOT, interpret, needs_interpreter
from wamkit.core.errors import UserError
from wamkit.train.config import TrainConfig
from wamkit.train.master_adamw import MasterAdamW
from wamkit.train.optim import build_optimizer, clip_gradients
from wamkit.train.parallelize import setup_model


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
    def groups(d):   # the two differ only in which torch kernel flag they set (foreach)
        return [{k: v for k, v in g.items() if k != "foreach"} for g in d["param_groups"]]

    assert groups(sd) == groups(ref_sd)
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


@needs_interpreter
def test_triton_kernel_equals_its_torch_form_in_the_interpreter():
    r = interpret(KERNEL_CHECK)
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


MULTI_CHECK = textwrap.dedent("""
    import copy, math
    import torch
    import torch.nn as nn
    from wamkit.train import master_adamw as M
    from wamkit.train.master import MasterWeights
    assert M.kernel_usable(torch.device("cpu")), "the interpreter should make the kernel usable"
    B = M.BLOCK
    # tensors of sizes off the block (and one of 1 element; b and c equal, in groups of different lr)
    shapes = {"a": (1,), "b": (777,), "c": (777,), "d": (B + 3,), "e": (2, B + 1), "f": (33, 12), "h": (B,)}
    gen = torch.Generator().manual_seed(0)
    net = nn.Module()
    for k, s in shapes.items():
        net.register_parameter(k, nn.Parameter(torch.randn(*s, generator=gen)))
    net.c.data.copy_(net.b.data)
    mw = MasterWeights(net, cast_root_inputs=False)
    pm = {n: (p, m) for (n, p), (_, m) in zip(net.named_parameters(), mw.trainable_pairs())}
    groups = [{"params": [pm[k][1] for k in "abde"], "lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95),
               "eps": 1e-8},
              {"params": [pm[k][1] for k in "cfh"], "lr": 3e-2, "weight_decay": 0.0, "betas": (0.8, 0.99),
               "eps": 1e-6}]
    opt = M.MasterAdamW(groups, mw, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    fp32_grad = set("dh")              # these get their gradient on the master (fp32), the others on the module
    gi_of = {k: 0 if k in "abde" else 1 for k in shapes}

    def set_grads(step):
        grads = {}
        for k, (p, m) in pm.items():
            g = torch.randn(*shapes[k], generator=gen)
            if k == "c":
                g = grads["b"].float()          # b and c see the same gradient: only their group differs
                if step % 2:                    # at an address off 16 bytes (the kernel's ALIGNED=False variant)
                    buf = torch.empty(g.numel() + 1, dtype=torch.bfloat16)
                    buf[1:] = g
                    p.grad = buf[1:]
                    assert p.grad.is_contiguous() and p.grad.data_ptr() % 16
                    grads[k] = p.grad
                    continue
            if k in fp32_grad:
                m.grad = g.clone()
            elif k == "f":                      # a gradient not contiguous (the kernel reads a contiguous copy)
                p.grad = g.to(torch.bfloat16).t().contiguous().t()
                assert not p.grad.is_contiguous()
            else:
                p.grad = g.to(torch.bfloat16)
            grads[k] = m.grad if k in fp32_grad else p.grad
        return grads

    def reference(grads, coef):
        out = {}
        for k, (p, m) in pm.items():
            st = opt.state[m]
            grp = groups[gi_of[k]]
            lr, (b1, b2), eps, wd = grp["lr"], grp["betas"], grp["eps"], grp["weight_decay"]
            s = float(st["step"]) + 1 if st else 1.0
            w = m.detach().clone()
            ea = st["exp_avg"].clone() if st else torch.zeros_like(w)
            es = st["exp_avg_sq"].clone() if st else torch.zeros_like(w)
            pp = torch.empty_like(p)
            M._step_torch(grads[k], w, ea, es, pp, coef, b1, b2, eps, 1 - lr * wd, lr / (1 - b1 ** s),
                          math.sqrt(1 - b2 ** s))
            out[k] = (w, ea, es, pp, s)
        return out

    def check(ref, what):
        for k, (p, m) in pm.items():
            st = opt.state[m]
            w, ea, es, pp, s = ref[k]
            for got, want, name in ((m.detach(), w, "w"), (st["exp_avg"], ea, "m"), (st["exp_avg_sq"], es, "v")):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{what} {name} {k}")
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), (what, k)
            assert float(st["step"]) == s, (what, k, float(st["step"]), s)

    for step in range(3):
        for grp, lr in zip(groups, (1e-2 * (step + 1), 3e-2 / (step + 1))):   # the scheduler changes lr
            grp["lr"] = lr
        grads = set_grads(step)
        coef = torch.tensor(0.37 + 0.1 * step)
        ref = reference(grads, coef)
        opt._coef = coef
        opt.step()
        check(ref, f"step {step}")
        assert opt.launches == 2, opt.launches          # one per gradient dtype, not one per tensor
        assert len(opt._plan.members) == len(shapes) and not opt._plan.slow
        # b and c: same values, same gradient, different groups: a table with the two swapped would fail above
        assert not torch.allclose(pm["b"][1], pm["c"][1])
        assert all(p.grad is None and m.grad is None for p, m in pm.values())
    plan = opt._plan

    # torch AdamW's format: step a float32 CPU scalar; the state loads into torch's AdamW and back
    sd = opt.state_dict()
    assert all(s["step"].dtype == torch.float32 and s["step"].device.type == "cpu" and s["step"].dim() == 0
               and float(s["step"]) == 3.0 for s in sd["state"].values())
    other = torch.optim.AdamW(copy.deepcopy(groups), foreach=True)
    other.load_state_dict(copy.deepcopy(sd))
    sd2 = copy.deepcopy(other.state_dict())
    for s in sd2["state"].values():
        s["step"] = torch.tensor(7.0)                    # a loaded state's step counts are the ones used
    opt.load_state_dict(sd2)
    grads = set_grads(3)
    ref = reference(grads, torch.tensor(1.0))
    assert all(r[4] == 8.0 for r in ref.values())
    opt.step()
    check(ref, "after load")
    assert opt._plan is not plan and opt.launches == 2

    # one gradient dtype: one launch for all tensors; a parameter without a gradient is skipped, its step kept
    fp32_grad.clear()
    grads = set_grads(4)
    a = pm.pop("a")
    a[0].grad = None
    ref = reference(grads, torch.tensor(1.0))
    opt.step()
    assert opt.launches == 1 and len(opt._plan.members) == len(shapes) - 1
    check(ref, "one dtype")
    assert float(opt.state[a[1]]["step"]) == 8.0
    print("MULTI_OK")
""")

RUN_CHECK = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])
    import test_master_adamw as T
    from wamkit.train import master_adamw as M
    assert M.kernel_usable(torch.device("cpu"))
    counts = []
    orig = M._Plan.step
    def counted(self, opt, coef):
        ok = orig(self, opt, coef)
        if ok:
            counts.append(opt.launches)
        return ok
    M._Plan.step = counted
    for ga in (1, 2):
        T.test_triton_impl_matches_the_default_master_path(ga)     # the same checks, on the multi-tensor kernel
        _, _, opt, _, _ = T._run("triton", ga=ga)
        assert len(opt._plan.members) == 6 and not opt._plan.slow and opt.launches == 1, (ga, opt.launches)
    assert counts and set(counts) == {1}, counts               # every step: one launch for the 6 tensors
    T.test_without_the_clip_the_result_differs()
    T.test_its_state_loads_into_torch_adamw_and_back()
    print("RUN_OK")
""")


@needs_interpreter
def test_multi_tensor_step_equals_the_torch_form_per_tensor_in_the_interpreter():
    """Several tensors (sizes off the block, one of 1 element, a non-contiguous gradient), two groups of different
    lr, wd, betas and eps, both gradient dtypes: the one-launch-per-dtype step is `_step_torch` tensor by tensor,
    over steps with a changing lr, after a state is loaded (its step counts used), and with a gradient missing."""
    r = interpret(MULTI_CHECK)
    assert r.returncode == 0 and "MULTI_OK" in r.stdout, r.stdout + r.stderr


@needs_interpreter
def test_triton_impl_matches_the_default_path_in_the_interpreter():
    """The comparisons above with the kernel running (one launch a step for all tensors), not its torch form."""
    r = interpret(RUN_CHECK, str(ROOT / "tests"))
    assert r.returncode == 0 and "RUN_OK" in r.stdout, r.stdout + r.stderr


def test_a_multi_kernel_that_cannot_build_falls_back_to_one_launch_per_tensor(monkeypatch, caplog):
    """Where the multi-tensor kernel fails at its first launch (it did not build, say), nothing of the step has
    run: the optimizer warns, steps every tensor with its own launch from then on, and counts each step once."""
    import types

    from wamkit.train import master_adamw as M

    class Broken:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise RuntimeError("no kernel for this device")
            return launch

    class PerTensor:                  # the per-tensor kernel, as its torch form (the interpreter test pins them)
        def __getitem__(self, grid):
            def launch(g, w, m, v, p, c, n, *args, BLOCK_SIZE):
                M._step_torch(g, w, m, v, p, c, *args)
            return launch

    monkeypatch.setattr(M, "kernel_usable", lambda device: True)
    monkeypatch.setattr(M, "triton", types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)))
    monkeypatch.setattr(M, "_master_adamw_multi_kernel", Broken(), raising=False)
    monkeypatch.setattr(M, "_master_adamw_kernel", PerTensor(), raising=False)
    ref_m, _, _, _, _ = _run("foreach")
    with caplog.at_level("WARNING"):
        m, _, opt, _, _ = _run("triton")
    assert opt.multi is False and "multi-tensor kernel is unavailable" in caplog.text
    assert opt.launches == len(list(opt.state))        # the last step: one launch per tensor
    assert {float(st["step"]) for st in opt.state.values()} == {4.0}
    for n in ref_m:
        torch.testing.assert_close(m[n], ref_m[n], rtol=1e-5, atol=1e-6, msg=n)
