"""shard=auto|fsdp|none on the CPU (one-rank gloo group): the plain-module path (none) trains like FSDP2 (first-step
loss within fp32 tolerance, close losses after), its bf16 master weights do FSDP2's mixed-precision arithmetic,
checkpoints cross between the two paths in both directions, bad values are refused naming the key, and the
device prefetcher keeps order, sampler states and errors."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
import torch.nn as nn

from test_train_support import BASE_ARGS, TinyNet, losses
from wamkit.core.config import load_config
from wamkit.core.errors import ConfigError, UserError
from wamkit.train import checkpoint as C
from wamkit.train.config import TrainConfig
from wamkit.train.data import DevicePrefetcher
from wamkit.train.dist import close_distributed, init_distributed
from wamkit.train.master import MasterWeights
from wamkit.train.optim import build_optimizer
from wamkit.train.parallelize import resolved_shard, setup_model
from wamkit.train.trainer import build_policy, train


def cfg_of(out, *args: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*BASE_ARGS, f"out={out}", "progress=false", *args])


@pytest.fixture
def one_rank():
    info = init_distributed("cpu")
    yield info
    close_distributed(info)


# ------------------------------------------------------------------------------------------------ config values

def test_shard_values_and_bad_values_name_the_key():
    assert load_config(TrainConfig, None, []).shard == "auto"
    assert load_config(TrainConfig, None, ["shard=none"]).shard == "none"
    with pytest.raises(ConfigError, match="shard"):
        load_config(TrainConfig, None, ["shard=ddp"])
    with pytest.raises(ConfigError, match="shard=none.*nproc=2"):
        load_config(TrainConfig, None, ["shard=none", "nproc=2"])
    assert load_config(TrainConfig, None, ["compile=model"]).compile == "model"
    with pytest.raises(ConfigError, match="compile=model needs activation_checkpointing=none"):
        load_config(TrainConfig, None, ["compile=model", "activation_checkpointing=vision"])
    with pytest.raises(ConfigError, match="compile"):
        load_config(TrainConfig, None, ["compile=whole model"])


def test_auto_is_none_on_one_rank_and_fsdp_on_more():
    assert resolved_shard("auto", 1) == "none" and resolved_shard("auto", 2) == "fsdp"
    assert resolved_shard("fsdp", 1) == "fsdp" and resolved_shard("none", 1) == "none"
    with pytest.raises(UserError, match="one rank"):
        resolved_shard("none", 2)


# ------------------------------------------------------------------------------------------------ numerics

def _wam_ref_tiny():
    pol = build_policy("wam-ref", {"size": "tiny"}, device="cpu")
    pol.apply_trainable_patterns(["*"])
    return pol


def _batch(pol, b: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    size, h = pol.spec.input.image_size, pol.spec.action.horizon
    return {"images": {c: torch.randint(0, 256, (b, size, size, 3), dtype=torch.uint8, generator=g)
                       for c in pol.spec.input.cameras},
            "task": ["put the bowl on the plate", "open the drawer"][:b],
            "actions": torch.rand(b, h, pol.model_action_dim, generator=g) * 2 - 1,
            "action_mask": torch.ones(b, h, dtype=torch.bool)}


def _steps(shard: str, precision: str, n: int = 2, ga: int = 1):
    """wam-ref tiny (all parameters trained) under setup_model(shard, precision): n optimizer steps (AdamW, grad
    clipping, `ga` micro-steps each) on fixed batches and noise. Returns (losses, full fp32 weights after, the
    TrainModel, optimizer)."""
    torch.manual_seed(0)
    pol = _wam_ref_tiny()
    pol.module.float().train()
    model = setup_model(pol.module, list(pol.fsdp_units()), "cpu", 1, shard=shard, mixed_precision=precision)
    opt = build_optimizer(model.state, TrainConfig(lr=1e-3), dict(pol.lr_multipliers()))
    params = [p for p in model.state.parameters() if p.requires_grad]
    out = []
    for s in range(n):
        for k in range(ga):
            model.before_backward(k == ga - 1)
            torch.manual_seed(10 * s + k)
            loss, _ = pol.sft_loss(_batch(pol))
            (loss / ga).backward()
            model.after_backward(k == 0)
            out.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        model.after_optimizer_step(opt)
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in model.state.named_parameters()}
    return out, weights, model, opt


def test_none_matches_fsdp_in_fp32(one_rank):
    a, wa, ma, _ = _steps("none", "fp32", n=3)
    b, wb, mb, _ = _steps("fsdp", "fp32", n=3)
    assert ma.shard == "none" and ma.state is ma.module and mb.shard == "fsdp"
    assert a[0] == pytest.approx(b[0], rel=1e-6, abs=1e-7)         # same weights, same batch: fp32 tolerance
    assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    assert wa.keys() == wb.keys()
    for n in wa:
        torch.testing.assert_close(wa[n], wb[n], rtol=1e-4, atol=1e-6, msg=n)


def test_none_bf16_master_weights_do_fsdp2_mixed_precision(one_rank, monkeypatch):
    """bf16 compute on bf16 copies, fp32 masters under the module's names, fp32 gradients accumulated over
    micro-steps: FSDP2's MixedPrecisionPolicy(bf16, fp32) arithmetic, bit for bit once the one difference (FSDP2
    also casts every unit's floating inputs to bf16: wam-ref's vision rotary cos/sin) is added by hooks."""
    from wamkit.train import parallelize as P
    from wamkit.train.master import cast_floating

    b, wb, _, _ = _steps("fsdp", "bf16", n=2, ga=2)
    plain, _, _, _ = _steps("none", "bf16", n=2, ga=2)
    assert plain == pytest.approx(b, rel=2e-3)            # without the unit casts: bf16 rounding apart

    class UnitCasts(MasterWeights):
        def __init__(self, module, *a, **k):
            super().__init__(module, *a, **k)
            for u in [*module.und.visual.blocks, *module.gen.blocks]:
                u.register_forward_pre_hook(cast_floating(torch.bfloat16), with_kwargs=True)

    monkeypatch.setattr(P, "MasterWeights", UnitCasts)
    a, wa, ma, opt = _steps("none", "bf16", n=2, ga=2)
    assert ma.master is not None and ma.precision == "bf16"
    assert all(p.dtype == torch.bfloat16 for p in ma.module.parameters())
    assert all(p.dtype == torch.float32 for p in ma.state.parameters())
    assert [n for n, _ in ma.state.named_parameters()] == [n for n, _ in ma.module.named_parameters()]
    # the optimizer holds the masters; the module's weights are the masters rounded to bf16
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in ma.state.parameters()}
    for (n, p), m in zip(ma.module.named_parameters(), ma.state.parameters()):
        assert torch.equal(p, m.to(torch.bfloat16)), n
        assert p.grad is None                           # moved to the master, dropped from the module
    assert a == b
    assert wa.keys() == wb.keys()
    for n in wa:
        assert torch.equal(wa[n], wb[n]), n


def test_master_grads_accumulate_in_fp32_over_micro_steps():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).float()
    frozen = net[0].bias
    frozen.requires_grad_(False)
    mw = MasterWeights(net)
    x = [torch.randn(3, 4) for _ in range(2)]
    want = None
    for k, xi in enumerate(x):
        net(xi).pow(2).sum().backward()                 # fp32 input: cast to bf16 by the root hook
        g = [p.grad.float().clone() for p in net.parameters() if p.requires_grad]
        want = g if want is None else [a + b for a, b in zip(want, g)]
        mw.grads_to_master(first=k == 0)
    got = [m.grad for m in mw.state.parameters() if m.requires_grad]
    assert len(got) == 3 and all(t.dtype == torch.float32 for t in got)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert frozen.dtype == torch.bfloat16 and mw.state.get_parameter("0.bias").grad is None
    net(x[0]).sum().backward()
    mw.grads_to_master(first=True)                      # a new step overwrites, not adds
    assert not torch.equal(mw.state.get_parameter("1.weight").grad, want[2])


def test_compile_model_is_the_root_and_refused_with_fsdp(one_rank, monkeypatch):
    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    net = TinyNet(6, 8, 2, 5)
    setup_model(net, [*net.blocks, net], "cpu", 1, shard="none", mixed_precision="fp32", compile="model")
    assert compiled == [net]
    net = TinyNet(6, 8, 2, 5)
    with pytest.raises(UserError, match="compile=model"):
        setup_model(net, [*net.blocks, net], "cpu", 1, shard="fsdp", mixed_precision="fp32", compile="model")
    with pytest.raises(UserError, match="activation_checkpointing=none"):
        setup_model(net, [*net.blocks, net], "cpu", 1, shard="none", compile="model", activation_checkpointing="full")
    assert len(compiled) == 1                                       # nothing compiled by the refused calls


# ------------------------------------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("save_shard,load_shard", [("none", "fsdp"), ("fsdp", "none")])
def test_bf16_checkpoint_crosses_between_none_and_fsdp(one_rank, tmp_path, save_shard, load_shard):
    """Weights (fp32 masters / FSDP2's fp32 shards) and AdamW state saved under one path load exactly under the
    other; shard=none then rounds them into its bf16 compute copies."""
    _, w, model, opt = _steps(save_shard, "bf16", n=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    C.save_checkpoint(tmp_path, 2, model=model.state, optimizer=opt, scheduler=sched, ema=None, sampler_state={},
                      samples_seen=4, meta={}, rank=0, world_size=1, keep_last=1)
    torch.manual_seed(5)
    pol = _wam_ref_tiny()
    pol.module.float().train()
    other = setup_model(pol.module, list(pol.fsdp_units()), "cpu", 1, shard=load_shard, mixed_precision="bf16")
    opt2 = build_optimizer(other.state, TrainConfig(lr=1e-3), dict(pol.lr_multipliers()))
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    r = C.load_checkpoint(C.latest_checkpoint(tmp_path), model=other.state, optimizer=opt2, scheduler=sched2,
                          ema=None, rank=0, world_size=1, seed=0)
    other.after_load()
    assert r.step == 2
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in other.state.named_parameters()}
    assert full.keys() == w.keys()
    for n in w:
        assert torch.equal(full[n], w[n]), n
    if other.master is not None:
        for (n, p), m in zip(other.module.named_parameters(), other.state.parameters()):
            assert torch.equal(p, m.to(torch.bfloat16)), n

    def moments(o, model_state):
        names = {id(p): n for n, p in model_state.named_parameters()}
        out = {}
        for p, st in o.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                t = st[k]
                out[(names[id(p)], k)] = t.full_tensor() if hasattr(t, "full_tensor") else t
        return out

    a, b = moments(opt, model.state), moments(opt2, other.state)
    assert set(a) <= set(b) and len(a) > 50
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # parameters that never got a gradient (the last text layer's query/MLP) have no state saved: fresh zeros
    assert {k[0] for k in set(b) - set(a)} == {n for n, p in model.state.named_parameters()
                                                if p.requires_grad and all(n != k[0] for k in a)}
    assert all(not b[k].any() for k in set(b) - set(a))


def test_trainer_run_resumes_across_shard_modes(tmp_path):
    """`wamkit train` in-process: a run stopped at step 3 under one shard mode and resumed under the other
    continues the uninterrupted run's losses (fp32 tolerance); the first-step losses of none and fsdp agree."""
    common = ["steps=6", "batch_size=8", "save_every=0", "log_every=1"]
    train(cfg_of(tmp_path / "none", *common, "shard=none"))
    train(cfg_of(tmp_path / "fsdp", *common, "shard=fsdp"))
    a, b = losses(tmp_path / "none"), losses(tmp_path / "fsdp")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert a[1] == pytest.approx(b[1], rel=1e-6, abs=1e-7)
    for s in range(1, 7):
        assert a[s] == pytest.approx(b[s], rel=1e-4, abs=1e-6)
    for first, then in (("none", "fsdp"), ("fsdp", "none")):
        part = tmp_path / f"{first}-{then}"
        train(cfg_of(part, *common, f"shard={first}", "stop_at=3"))
        train(cfg_of(part, *common, f"shard={then}", "resume=true"))
        c = losses(part)
        assert sorted(c) == list(range(1, 7))
        for s in range(1, 7):
            assert c[s] == pytest.approx(a[s], rel=1e-4, abs=1e-6), (first, then, s)
    shutil.rmtree(tmp_path)


# ------------------------------------------------------------------------------------------------ prefetcher

def _source(n_fail: int | None = None):
    state = {"i": 0}

    def take():
        i = state["i"]
        if n_fail is not None and i == n_fail:
            raise UserError("the data sampler yields no samples")
        state["i"] += 1
        return {"x": torch.full((2,), float(i)), "images": {"cam": torch.zeros(1, 2, 2, 3, dtype=torch.uint8)},
                "task": [f"t{i}"]}, {"position": i + 1}
    return take


@pytest.mark.parametrize("thread", [False, True])
def test_prefetcher_keeps_order_states_and_errors(thread):
    pre = DevicePrefetcher(_source(n_fail=5), torch.device("cpu"), host_keys=("images",), thread=thread,
                           initial_state={"position": 0})
    assert pre.state == {"position": 0}
    for i in range(5):
        b = pre.next()
        assert float(b["x"][0]) == i and b["task"] == [f"t{i}"]
        assert pre.state == {"position": i + 1}              # the state of the batch just returned, not the read-ahead
    with pytest.raises(UserError, match="no samples"):
        pre.next()
    pre.close()
    assert not any(t.name == "wamkit-prefetch" for t in threading.enumerate())


def test_prefetcher_thread_stops_while_ahead():
    pre = DevicePrefetcher(_source(), torch.device("cpu"), thread=True)
    pre.next()
    pre.close()                                                # the thread is blocked on a full queue: it ends
    assert not any(t.name == "wamkit-prefetch" for t in threading.enumerate())
