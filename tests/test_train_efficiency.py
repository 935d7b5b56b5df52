"""The trainer's step-cost options on the CPU (one-rank gloo group, tiny models): activation checkpointing modes are
bit-identical to no checkpointing in fp32, the AdamW kernels (fused / foreach / for-loop) agree on FSDP2's DTensor
parameters, reshard_after_forward changes nothing numerically, the loop logs its data wait and step time, and
bench/bench_train.py writes the fields the GPU comparison reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from test_train_support import BASE_ARGS, ROOT, TinyNet, env, losses
from wamkit.core.config import load_config
from wamkit.core.errors import ConfigError, UserError
from wamkit.train.config import TrainConfig, ac_mode
from wamkit.train.dist import close_distributed, init_distributed
from wamkit.train.optim import build_optimizer
from wamkit.train.parallelize import checkpoint_targets, parallelize, resolved_reshard
from wamkit.train.trainer import build_policy, train


def cfg_of(out, *args: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*BASE_ARGS, f"out={out}", "progress=false", *args])


def tiny_batch(pol, b: int) -> dict:
    """A fixed batch in the training format (uint8 images per camera, task, actions in model space, mask)."""
    g = torch.Generator().manual_seed(0)
    size, h = pol.spec.input.image_size, pol.spec.action.horizon
    return {"images": {c: torch.randint(0, 256, (b, size, size, 3), dtype=torch.uint8, generator=g)
                       for c in pol.spec.input.cameras},
            "task": ["put the bowl on the plate", "open the drawer", "x"][:b],
            "actions": torch.rand(b, h, pol.model_action_dim, generator=g) * 2 - 1,
            "action_mask": torch.ones(b, h, dtype=torch.bool)}


@pytest.fixture
def one_rank():
    info = init_distributed("cpu")
    yield info
    close_distributed(info)


# ------------------------------------------------------------------------------------------------ config values

@pytest.mark.parametrize("given,want", [(True, "full"), (False, "none"), ("true", "full"), ("False", "none"),
                                        ("yes", "full"), ("0", "none"), ("", "none"), ("FULL", "full"),
                                        ("vision", "vision"), ("gen.blocks.*", "gen.blocks.*"),
                                        ("und.visual.*, gen.blocks.*", "und.visual.*,gen.blocks.*")])
def test_activation_checkpointing_values(given, want):
    assert ac_mode(given) == want


def test_activation_checkpointing_config_key():
    assert load_config(TrainConfig, None, ["activation_checkpointing=true"]).activation_checkpointing == "full"
    assert load_config(TrainConfig, None, {"activation_checkpointing": False}).activation_checkpointing == "none"
    assert load_config(TrainConfig, None, []).activation_checkpointing == "none"            # the default: off
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        load_config(TrainConfig, None, ["activation_checkpointing=gen blocks"])
    with pytest.raises(ConfigError, match="reshard_after_forward"):
        load_config(TrainConfig, None, ["reshard_after_forward=maybe"])


def test_reshard_after_forward_auto_is_off_on_one_rank_only():
    assert resolved_reshard("auto", 1) is False and resolved_reshard("auto", 2) is True
    assert resolved_reshard("true", 1) is True and resolved_reshard("false", 8) is False
    assert resolved_reshard(False, 2) is False


# ------------------------------------------------------------------------------------------------ AC targets

def _wam_ref_tiny(all_trainable: bool = True):
    pol = build_policy("wam-ref", {"size": "tiny"}, device="cpu")
    if all_trainable:
        pol.apply_trainable_patterns(["*"])
    return pol


def test_checkpoint_targets_by_mode():
    pol = _wam_ref_tiny()
    root, units = pol.module, [u for u in pol.fsdp_units() if u is not pol.module]
    full = checkpoint_targets(root, units, "full")
    vision = checkpoint_targets(root, units, "vision")
    assert checkpoint_targets(root, units, "none") == []
    assert len(full) == len(units) and set(vision) < set(full)
    assert vision == [f"und.visual.blocks.{i}" for i in range(len(pol.model.und.visual.blocks))]
    # globs: the outermost matching modules, also modules that are no FSDP unit (text layers in the root's group)
    text = checkpoint_targets(root, units, "und.language_model.layers.*")
    assert text == [f"und.language_model.layers.{i}" for i in range(len(pol.model.und.language_model.layers))]
    both = checkpoint_targets(root, units, "gen.blocks.1,gen.blocks.*")
    assert both == [f"gen.blocks.{i}" for i in range(len(pol.model.gen.blocks))]
    with pytest.raises(UserError, match="match no module"):
        checkpoint_targets(root, units, "und.vision.blocks.*")


def test_vision_mode_refuses_a_policy_without_a_vision_tower():
    net = TinyNet(4, 8, 2, 3)
    with pytest.raises(UserError, match="vision"):
        checkpoint_targets(net, list(net.blocks), "vision")


# ------------------------------------------------------------------------------------------------ numerics

def _first_step(mode: str, reshard: str = "true"):
    """Loss and every gradient of one fp32 forward + backward of wam-ref tiny (all parameters trained) under
    `parallelize` with activation_checkpointing=mode, on a fixed batch with fixed noise."""
    torch.manual_seed(0)
    pol = _wam_ref_tiny()
    pol.module.float().train()
    parallelize(pol.module, list(pol.fsdp_units()), "cpu", 1, mixed_precision="fp32", activation_checkpointing=mode,
                reshard_after_forward=reshard)
    from torch.distributed._composable.contract import _get_registry

    root, units = pol.module, [u for u in pol.fsdp_units() if u is not pol.module]
    want = set(checkpoint_targets(root, units, ac_mode(mode)))
    assert {n for n, m in root.named_modules() if "checkpoint" in (_get_registry(m) or {})} == want
    batch = tiny_batch(pol, 3)
    torch.manual_seed(1)
    loss, _ = pol.sft_loss(batch)
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in pol.module.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_activation_checkpointing_modes_are_bit_identical_in_fp32(one_rank):
    ref_loss, ref = _first_step("none")
    assert len(ref) > 50 and any(n.startswith("und.visual") for n in ref) and any(n.startswith("und.language")
                                                                                  for n in ref)
    for mode in ("full", "vision", "und.visual.blocks.1,gen.blocks.*", "true"):
        loss, grads = _first_step(mode, reshard="false" if mode == "full" else "true")
        assert torch.equal(loss, ref_loss), mode
        assert grads.keys() == ref.keys(), mode
        bad = [n for n in ref if not torch.equal(grads[n], ref[n])]
        assert not bad, (mode, bad[:5])


def test_adamw_kernels_agree_on_fsdp2_dtensor_params(one_rank):
    """fused / foreach / for-loop AdamW over FSDP2-sharded (DTensor) parameters after one identical backward."""
    from torch.distributed.tensor import DTensor

    out = {}
    for impl in ("for-loop", "foreach", "fused"):
        torch.manual_seed(0)
        net = TinyNet(6, 16, 2, 5)
        parallelize(net, [*net.blocks, net], "cpu", 1, mixed_precision="fp32")
        assert all(isinstance(p, DTensor) for p in net.parameters())
        cfg = TrainConfig(optimizer_impl=impl, lr=1e-2)
        opt = build_optimizer(net, cfg, {"inp.*": 5.0})
        assert opt.defaults["fused"] is (True if impl == "fused" else None)
        assert opt.defaults["foreach"] is (None if impl == "fused" else impl == "foreach")
        for _ in range(2):
            x = torch.linspace(-1, 1, 4 * 6).view(4, 6)
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[impl] = {n: p.full_tensor().clone() for n, p in net.named_parameters()}
    for impl in ("foreach", "fused"):
        for n, p in out["for-loop"].items():
            torch.testing.assert_close(out[impl][n], p, rtol=1e-6, atol=1e-7, msg=f"{impl} {n}")
    moved = [n for n, p in out["for-loop"].items() if not torch.equal(p, TinyNet(6, 16, 2, 5).state_dict()[n])]
    assert moved   # the step did something


# ------------------------------------------------------------------------------------------------ trainer

def test_trainer_options_keep_the_losses_and_log_wait_and_step_time(tmp_path):
    base = ["steps=4", "batch_size=8", "log_every=1", "num_workers=0"]
    train(cfg_of(tmp_path / "a", *base))
    train(cfg_of(tmp_path / "b", *base, "shard=fsdp", "activation_checkpointing=full", "reshard_after_forward=false",
                 "gc_every=1", "cast_root_inputs=false"))
    train(cfg_of(tmp_path / "c", *base, "activation_checkpointing=blocks.*", "optimizer_impl=fused"))
    a, b, c = losses(tmp_path / "a"), losses(tmp_path / "b"), losses(tmp_path / "c")
    assert sorted(a) == sorted(b) == sorted(c) == [1, 2, 3, 4]
    assert a == b                              # same arithmetic, bit for bit (a: shard=none, the default on 1 rank)
    assert a[1] == c[1]                                         # the optimizer acts after the first loss
    for s in (2, 3, 4):
        assert c[s] == pytest.approx(a[s], rel=1e-5, abs=1e-7)
    rows = [json.loads(ln) for ln in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["data_wait_s"] >= 0 and r["step_s"] > 0 and r["grad_norm"] > 0


# ------------------------------------------------------------------------------------------------ bench

@pytest.mark.slow
def test_bench_train_json_has_the_run_to_run_fields(tmp_path):
    out = tmp_path / "train.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_train.py"), "nproc=1", "runs=2", "steps=2", "warmup=1",
           "batch=2", "data=loader", "num_workers=0", f"json={out}", f"out={tmp_path / 'train.md'}"]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    (s,) = d["summary"]
    assert s["runs"] == 2 and len(s["per_run_samples_per_s"]) == 2 and s["spread"] >= 0
    assert s["samples_per_s"] > 0 and s["mfu"] is None                       # no MFU on the CPU
    assert s["shard"] == "none" and len(s["per_run_first_step_s"]) == 2
    assert len(d["rows"]) == 2
    for r in d["rows"]:
        assert r["measured_steps"] == 2 and len(r["step_times_s"]) == 3
        for k in ("step_s", "host_s", "gpu_lag_s", "cpu_s", "data_wait_s", "fwd_s", "bwd_s", "opt_s"):
            assert len(r["per_step"][k]) == 2 and k in r["median"]
        assert r["tflop_per_step"] > 0 and r["host"]["cpu_count"] >= 1 and r["data"] == "loader"
        assert r["ac"] == "none" and r["global_batch"] == 2 and r["shard"] == "none"     # auto on one rank
        assert r["first_step_s"] > 0 and r["build_s"] > 0
    assert "spread between runs" in (tmp_path / "train.md").read_text()


def test_compile_selection_and_gc_every_config():
    cfg = load_config(TrainConfig, None, ["compile=true", "gc_every=50"])
    assert cfg.compile == "full" and cfg.gc_every == 50
    assert load_config(TrainConfig, None, ["compile=und.language_model.layers.*"]).compile == \
        "und.language_model.layers.*"
    with pytest.raises(ConfigError, match="gc_every"):
        load_config(TrainConfig, None, ["gc_every=-1"])


def test_gc_every_turns_automatic_gc_off_for_the_loop_only(tmp_path, monkeypatch):
    import gc

    seen = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: (seen.append((a, gc.isenabled())), real_collect(*a))[1])
    train(cfg_of(tmp_path, "steps=4", "batch_size=8", "gc_every=2"))
    assert gc.isenabled()                                            # restored after training
    assert [a for a, _ in seen].count((1,)) == 2                     # steps 2 and 4
    assert all(not on for a, on in seen if a == (1,))               # collected by hand while automatic GC was off


def test_compile_applies_to_the_selected_modules(one_rank, monkeypatch):
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    net = TinyNet(6, 8, 3, 5)
    parallelize(net, [*net.blocks, net], "cpu", 1, mixed_precision="fp32", compile="blocks.1,out")
    assert compiled == [net.blocks[1], net.out]
    net = TinyNet(6, 8, 3, 5)
    compiled.clear()
    parallelize(net, [*net.blocks, net], "cpu", 1, mixed_precision="fp32", compile=True)   # true: every unit
    assert compiled == list(net.blocks)


def test_cast_root_inputs_false_keeps_the_flow_time_fp32_under_bf16(one_rank, monkeypatch):
    """bf16 mixed precision: FSDP2 casts the root's forward inputs (wam-ref's t, actions, noise) to bf16 unless
    cast_root_inputs=False; both run forward and backward."""
    from wamkit.policies.wam_ref import model as M

    seen = []
    orig = M.GenerationTower.time_embedding
    monkeypatch.setattr(M.GenerationTower, "time_embedding", lambda self, t: (seen.append(t.dtype), orig(self, t))[1])
    for cast, want in ((True, torch.bfloat16), (False, torch.float32)):
        torch.manual_seed(0)
        pol = _wam_ref_tiny()
        pol.module.float().train()
        parallelize(pol.module, list(pol.fsdp_units()), "cpu", 1, mixed_precision="bf16", cast_root_inputs=cast)
        loss, _ = pol.sft_loss(tiny_batch(pol, 2))
        loss.backward()
        assert seen[-1] == want and torch.isfinite(loss)
        assert pol.model.gen.action_in.weight.grad is not None
