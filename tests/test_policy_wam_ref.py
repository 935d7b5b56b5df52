"""wam-ref on CPU: shapes, batch invariance, determinism, prefix reuse, training signal, export, sizes."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies import make_policy

TASKS = ["put the bowl on the plate", "open the top drawer and put the bowl inside", "pick up the ketchup",
         "turn on the stove", "put both the alphabet soup and the tomato sauce in the basket"]


def _obs(n: int, seed: int = 0, size: int = 96, state_dim: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    return [Observation(images={"image": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
                                "wrist_image": rng.integers(0, 256, (size, size, 3), dtype=np.uint8)},
                        state=rng.standard_normal(state_dim).astype(np.float32) if state_dim else None,
                        task=TASKS[i % len(TASKS)]) for i in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return make_policy("wam-ref", size="tiny", num_inference_steps=4)


def test_predict_shape_and_spec(tiny):
    a = tiny.predict(_obs(3), [0, 1, 2])
    assert a.shape == (3, 16, 7) and a.dtype == np.float32 and np.isfinite(a).all()
    assert tiny.spec.name == "wam-ref" and tiny.spec.trainable and tiny.spec.input.cameras == ("image", "wrist_image")
    assert tiny.num_parameters()["total"] <= 5_000_000


@pytest.mark.parametrize("state_dim", [0, 8])
def test_identical_alone_and_in_batch(state_dim):
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=3, state_dim=state_dim)
    obs, seeds = _obs(5, seed=1, state_dim=state_dim), [11, 12, 13, 14, 15]
    batch = pol.predict(obs, seeds)
    alone = np.stack([pol.predict([o], [s])[0] for o, s in zip(obs, seeds)])
    np.testing.assert_array_equal(batch, alone)
    # a different order / other batch mates: same rows
    perm = [3, 0, 4]
    np.testing.assert_array_equal(pol.predict([obs[i] for i in perm], [seeds[i] for i in perm]), batch[perm])


def test_determinism_and_seed_dependence(tiny):
    obs = _obs(2, seed=2)
    a1, a2 = tiny.predict(obs, [5, 6]), tiny.predict(obs, [5, 6])
    np.testing.assert_array_equal(a1, a2)
    assert not np.allclose(tiny.predict(obs, [7, 6])[0], a1[0])
    fresh = make_policy("wam-ref", size="tiny", num_inference_steps=4)  # same init_seed -> same weights
    np.testing.assert_array_equal(fresh.predict(obs, [5, 6]), a1)


@pytest.mark.parametrize("steps", [1, 6])
def test_prefix_computed_once_per_observation(tiny, steps):
    calls, gen_calls = [], []
    # the token embedding runs once per understanding pass (transformers' forward or the fused prefix pass)
    h1 = tiny.model.und.language_model.embed_tokens.register_forward_pre_hook(
        lambda m, a: calls.append(int(a[0].shape[0])))
    h2 = tiny.model.gen.blocks[0].register_forward_pre_hook(lambda m, a: gen_calls.append(1))
    try:
        tiny.num_inference_steps = steps
        tiny.predict(_obs(3), [0, 1, 2])
    finally:
        tiny.num_inference_steps = 4
        h1.remove()
        h2.remove()
    assert calls == [3]              # one understanding pass over the 3 observations, whatever the step count
    assert len(gen_calls) == steps   # the generation tower (its first block) runs once per denoising step


def _synthetic_batch(pol, n=8, seed=0):
    """Actions that depend on the image (a colour per sample) and the task: learnable from the prefix."""
    rng = np.random.default_rng(seed)
    colors = rng.integers(0, 256, (n, 3))
    imgs = {c: np.broadcast_to(colors[:, None, None, :], (n, 64, 64, 3)).astype(np.uint8).copy()
            for c in pol.cameras}
    base = rng.uniform(-1, 1, (n, 1, pol.model_action_dim)).astype(np.float32)
    ramp = np.linspace(-0.5, 0.5, pol.horizon, dtype=np.float32)[None, :, None]
    actions = np.clip(base + ramp * np.sign(base), -1, 1).astype(np.float32)
    return {"images": imgs, "task": [TASKS[i % len(TASKS)] for i in range(n)], "actions": actions,
            "action_mask": np.ones((n, pol.horizon), bool)}


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core CI box OpenMP threads that spin on oversubscribed cores are
    many times slower than one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_loss_decreases_on_cpu(one_thread):
    torch.manual_seed(0)
    pol = make_policy("wam-ref", size="tiny")
    module = pol.module
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    assert params and all(n.startswith("gen.") for n in pol.trainable_parameter_names())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    batch = _synthetic_batch(pol)
    losses = []
    for _ in range(150):
        loss, metrics = pol.sft_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(metrics["loss"])
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    assert last < 0.5 * first, (first, last)
    # frozen understanding tower got no gradients
    assert all(p.grad is None for p in module.und.parameters())


def test_trainer_interface(tiny):
    import fnmatch

    names = [n for n, _ in tiny.module.named_parameters()]
    mult = tiny.lr_multipliers()
    assert mult and all(any(fnmatch.fnmatchcase(n, g) for n in names) for g in mult)
    assert all(v == 5.0 for v in mult.values())
    units = tiny.fsdp_units()
    assert units[-1] is tiny.module and len(units) == 2 + 4 + 4 + 1  # vision blocks, und layers, gen blocks, root
    # the action pipeline is settable when the model-space dimension stays the same
    from wamkit.data.transforms import ActionPipeline, QuantileNormalizeStep

    old = tiny.action_pipeline
    tiny.action_pipeline = ActionPipeline([QuantileNormalizeStep([-1] * 7, [1] * 7)])
    tiny.action_pipeline = old
    with pytest.raises(UserError):
        tiny.action_pipeline = "rot6d"


def test_rot6d_pipeline_predicts_env_space():
    from wamkit.data.transforms import ActionPipeline, QuantileNormalizeStep, Rot6dStep

    pipe = ActionPipeline([Rot6dStep(), QuantileNormalizeStep([-1] * 10, [1] * 10)])
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2, action_pipeline=pipe)
    assert pol.model_action_dim == 10 and pol.module.gen.action_out.out_features == 10
    a = pol.predict(_obs(2), [0, 1])
    assert a.shape == (2, 16, 7)
    assert np.all(np.linalg.norm(a[..., 3:6], axis=-1) <= np.pi + 1e-5)  # axis-angle from rot6d


def test_export_round_trip(tmp_path):
    from wamkit.data.transforms import ActionPipeline, QuantileNormalizeStep, Rot6dStep

    pipe = ActionPipeline([Rot6dStep(), QuantileNormalizeStep(np.linspace(-1, 0, 10), np.linspace(0.5, 1, 10))])
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=3, action_pipeline=pipe, state_dim=4,
                      init_seed=3)
    with torch.no_grad():  # weights that differ from any fresh init
        for p in pol.module.gen.parameters():
            p.add_(0.01)
    obs = _obs(3, seed=4, state_dim=4)
    before = pol.predict(obs, [1, 2, 3])
    out = pol.save_pretrained(tmp_path / "export")
    assert {f.name for f in out.iterdir()} >= {"wamkit_policy.json", "model.safetensors", "action_pipeline.json"}
    loaded = make_policy(str(out))
    assert type(loaded).__name__ == "WamRefPolicy" and loaded.spec == pol.spec
    np.testing.assert_array_equal(loaded.predict(obs, [1, 2, 3]), before)
    fewer = make_policy(str(out), num_inference_steps=1)  # overrides
    assert fewer.num_inference_steps == 1


def test_und_path_loads_local_qwen3vl_weights(tmp_path):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from wamkit.policies.wam_ref.sizes import qwen3vl_config_dict

    torch.manual_seed(1)
    full = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**qwen3vl_config_dict("tiny")))
    full.save_pretrained(tmp_path / "qwen")
    pol = make_policy("wam-ref", size="tiny", und_path=str(tmp_path / "qwen"), num_inference_steps=2)
    ref = full.model.state_dict()
    for k, v in pol.module.und.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)
    assert pol.predict(_obs(1), [0]).shape == (1, 16, 7)
    with pytest.raises(UserError):
        make_policy("wam-ref", size="tiny", und_path=str(tmp_path / "missing"))


def _expected_nano_params() -> dict[str, int]:
    h, L, ffn, nh, kv, hd, vocab = 4096, 36, 12288, 32, 8, 128, 151936
    attn = h * nh * hd + 2 * h * kv * hd + nh * hd * h + 2 * hd     # q, k, v, o (no bias) + q_norm, k_norm
    layer = attn + 3 * h * ffn + 2 * h                               # + SwiGLU MLP + 2 RMSNorms
    und_text = vocab * h + L * layer + h
    vh, vd, vffn, p, m, out = 1152, 27, 4304, 16, 2, 4096
    vblock = 4 * vh + (vh * 3 * vh + 3 * vh) + (vh * vh + vh) + (vh * vffn + vffn) + (vffn * vh + vh)
    mh = vh * m * m
    merger = lambda norm_dim: 2 * norm_dim + mh * mh + mh + mh * out + out  # noqa: E731
    vision = (3 * 2 * p * p * vh + vh) + 2304 * vh + vd * vblock + merger(vh) + 3 * merger(mh)
    gen_layer = attn + 3 * h * ffn + 6 * h                           # + AdaLN table (6, h)
    gen = L * gen_layer + (7 * h + h) + (256 * h + h + h * h + h) + (h * 6 * h + 6 * h) + (h * 2 * h + 2 * h) \
        + (h * 7 + 7)
    return {"und": und_text + vision, "gen": gen, "total": und_text + vision + gen}


def test_nano_shape_on_meta_device():
    import resource

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    pol = make_policy("wam-ref", size="nano-shape", device="meta", dtype="bfloat16")
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert all(p.is_meta for p in pol.module.parameters())
    counts = pol.num_parameters()
    exp = _expected_nano_params()
    assert counts["und"] == exp["und"] and counts["gen"] == exp["gen"] and counts["total"] == exp["total"]
    assert 15.0e9 < counts["total"] < 15.5e9
    assert (rss1 - rss0) * 1024 < 1.0e9   # ~60 GB if it had been allocated in fp32
    f = pol.flops_per_observation(num_inference_steps=30, prefix_len=316)
    assert 9e12 < f["total"] < 13e12      # the reference measurement quotes ~11 TFLOP per observation
    with pytest.raises(UserError):
        pol.predict(_obs(1), [0])


def test_meta_build_materializes_to_the_cpu_build():
    cpu = make_policy("wam-ref", size="tiny", num_inference_steps=2)
    meta = make_policy("wam-ref", size="tiny", num_inference_steps=2, device="meta").materialize("cpu")
    for (k, a), (_, b) in zip(cpu.module.state_dict().items(), meta.module.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    for name, buf in cpu.module.named_buffers():
        torch.testing.assert_close(buf, dict(meta.module.named_buffers())[name], rtol=0, atol=0)
    obs = _obs(2)
    np.testing.assert_array_equal(cpu.predict(obs, [0, 1]), meta.predict(obs, [0, 1]))


def test_bad_inputs(tiny):
    o = _obs(1)[0]
    with pytest.raises(UserError):
        tiny.predict([Observation(images={"image": o.images["image"]}, state=None, task="x")], [0])
    with pytest.raises(UserError):
        make_policy("wam-ref", size="huge")
    with pytest.raises(UserError):
        make_policy("wam-ref", size="tiny", state_dim=3).predict(_obs(1), [0])


def _prefix_inputs(pol, n=3, state_dim=8):
    obs = _obs(n, state_dim=state_dim)
    inp = pol.prepare_inputs([o.images for o in obs], TASKS[:n], [o.state for o in obs] if state_dim else None)
    p = pol.model.encode_prefix(inp["input_ids"], inp["attention_mask"], inp["mm_token_type_ids"],
                                inp["pixel_values"], inp["image_grid_thw"], inp["position_ids"])
    return inp, p


@torch.no_grad()
def test_kv_room_layout_matches_concat():
    """The inference K/V layout (scratch slots written in place, heads expanded or not) computes the same velocity
    as the training layout (prefix K/V concatenated with the action tokens' every call): one Euler step of
    `denoise` from t = 0 is x + velocity(x, 0)."""
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8)
    inp, p = _prefix_inputs(pol)
    m = pol.model
    x = torch.randn(3, pol.horizon, pol.model_action_dim)
    ref = x + m.velocity(p, x, torch.zeros(3), inp["state"]).float()
    tc = pol.qwen_config.text_config
    for heads in (tc.num_key_value_heads, tc.num_attention_heads):
        room = p.with_room(pol.gen_tokens, heads)
        assert room.keys[0].shape == (3, heads, p.keys[0].shape[2] + pol.gen_tokens, p.keys[0].shape[3])
        torch.testing.assert_close(room.keys[1][:, ::heads // tc.num_key_value_heads, :-pol.gen_tokens], p.keys[1])
        for _ in range(2):  # the scratch slots are overwritten, not accumulated: a second call gives the same
            out = m.gen.denoise(room, x, inp["state"], 1)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("layout", ["expanded", "room", "folded"])
def test_denoise_matches_step_by_step_velocity(layout):
    """GenerationTower.denoise (invariants hoisted out of the loop, in-place K/V slots) = the plain Euler loop
    over the training-layout velocity, and the policy's sample() is that loop."""
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=5, state_dim=8, kv_layout=layout)
    inp, p = _prefix_inputs(pol)
    m = pol.model
    x0 = pol.noise([1, 2, 3])
    x = x0.clone()
    for k in range(5):
        x = x + m.velocity(p, x, torch.full((3,), k / 5), inp["state"]).float() / 5
    heads = pol.engine.kv_heads()
    out = m.gen.denoise(p.with_room(pol.gen_tokens, heads), x0, inp["state"], 5)
    torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pol.sample(inp, [1, 2, 3]), out, rtol=0, atol=0)


@torch.no_grad()
def test_folded_attention_equals_grouped_query_attention():
    """model.attend(fold=True) (each kv head's query heads stacked along the query axis, plain SDPA) gives what
    SDPA with enable_gqa gives and what attention over K/V repeated to every query head gives, with keys masked
    differently per row; a mask with a query axis cannot be folded and says so."""
    from wamkit.policies.wam_ref.model import additive_mask, attend

    g = torch.Generator().manual_seed(0)
    b, h, kvh, n, s, hd = 3, 8, 2, 5, 11, 16
    q, k, v = (torch.randn(b, hh, length, hd, generator=g) for hh, length in ((h, n), (kvh, s), (kvh, s)))
    keep = torch.rand(b, s, generator=g) > 0.3
    keep[:, -n:] = True
    mask = additive_mask(keep, torch.float32)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1), attn_mask=mask)
    folded, gqa = attend(q, k, v, mask, fold=True), attend(q, k, v, mask, fold=False)
    assert folded.shape == (b, h, n, hd)
    torch.testing.assert_close(folded, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gqa, ref, rtol=1e-5, atol=1e-6)
    # the query heads really read different kv heads (a wrong grouping would not match ref)
    wrong = attend(q[:, torch.arange(h).roll(1)], k, v, mask, fold=True)[:, torch.arange(h).roll(-1)]
    assert not torch.allclose(wrong, ref, atol=1e-3)
    with pytest.raises(ValueError, match="keys only"):
        attend(q, k, v, mask.expand(b, 1, n, s), fold=True)


@torch.no_grad()
def test_folded_attention_takes_a_transposed_sdpa_output(monkeypatch):
    """SDPA's memory-efficient backend (chosen on GPUs without cuDNN attention, e.g. sm80) returns its output
    strided as (B, S, H, hd) transposed; folded attention must regroup it by value, not by a view of its strides
    (the H100 run of bench_attention.py refused that backend with a view error)."""
    from wamkit.policies.wam_ref import model as wam_model

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)   # same values, efficient-backend strides

    g = torch.Generator().manual_seed(1)
    b, h, kvh, n, s, hd = 2, 8, 2, 4, 9, 16
    q, k, v = (torch.randn(b, hh, length, hd, generator=g) for hh, length in ((h, n), (kvh, s), (kvh, s)))
    mask = wam_model.additive_mask(torch.rand(b, s, generator=g) > 0.2, torch.float32)
    want = wam_model.attend(q, k, v, mask, fold=True)
    monkeypatch.setattr(wam_model.F, "scaled_dot_product_attention", transposed_sdpa)
    got = wam_model.attend(q, k, v, mask, fold=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@torch.no_grad()
def test_kv_layout_switch_at_run_time():
    """Setting kv_layout on a built policy (bench scripts do) reaches every generation block and changes kernels,
    not actions; an unknown layout is refused there too."""
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=3, state_dim=8)
    inp, _ = _prefix_inputs(pol)
    ref = pol.sample(inp, [4, 5, 6])
    for layout in ("folded", "room", "expanded"):
        pol.kv_layout = layout
        assert [blk.fold_gqa for blk in pol.model.gen.blocks] == [layout == "folded"] * len(pol.model.gen.blocks)
        torch.testing.assert_close(pol.sample(inp, [4, 5, 6]), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kv_layout"):
        pol.kv_layout = "cat"


def test_position_ids_match_transformers_get_rope_index():
    """The host-side mRoPE positions (cached template x mask) equal transformers' get_rope_index, for prompts of
    different text lengths (one filling max_text_len exactly) and for each camera count."""
    for cams in (("image", "wrist_image"), ("image",)):
        pol = make_policy("wam-ref", size="tiny", cameras=cams, max_text_len=24)
        tasks = ["a", "pick up the bowl", "x" * 24, "put the bowl on the plate and then open the drawer"]
        obs = _obs(4)
        inp = pol.prepare_inputs([{c: o.images[c] for c in cams} for o in obs], tasks)
        ref, _ = pol.model.und.get_rope_index(inp["input_ids"], inp["mm_token_type_ids"],
                                              image_grid_thw=inp["image_grid_thw"],
                                              attention_mask=inp["attention_mask"])
        assert inp["attention_mask"].sum(1).unique().numel() > 1   # the prompts really differ in length
        torch.testing.assert_close(inp["position_ids"], ref, rtol=0, atol=0)


def test_graph_buckets_and_warmup():
    from wamkit.policies.wam_ref.config import graph_buckets as _buckets

    assert _buckets(None, 64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert _buckets(None, 6) == (1, 2, 4, 6)
    assert _buckets("3,1,40", 8) == (1, 3, 8)
    from wamkit.policies.wam_ref.config import bucket_for   # the graph a batch runs: padded up, or its own above all
    assert [bucket_for((1, 2, 4, 8), n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 9]
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2, max_batch_size=8)
    assert pol.engine.graph_bucket(5) == 8 and pol.engine.graph_bucket(1) == 1
    assert list(pol.warmup(8)) == ["1"]   # on the CPU: one predict (graphs are CUDA-only)
    with pytest.raises(UserError, match="kv_layout"):
        make_policy("wam-ref", size="tiny", kv_layout="cat")


@pytest.mark.parametrize("compile_prefix, prefix_fold", [("layers", False), ("layers", True), ("modules", False)])
def test_compile_gives_the_same_actions(one_thread, compile_prefix, prefix_fold):
    """compile=true (torch.compile of the generation blocks, the prefix's text layers and the understanding tower's
    vision layers; Inductor's C++ backend here, Triton on GPUs) changes kernels, not arithmetic: same actions to
    float32 rounding, for two batch sizes (the second one recompiles with a dynamic batch dimension), with the text
    layers compiled whole (compile_prefix=layers, q folded or not) or module by module, with the prefix's masked
    attention (prefix_fold applies to it; the causal default is compiled in test_wam_ref_fused)."""
    from wamkit.policies.wam_ref import prefix as wp

    kw = dict(size="tiny", num_inference_steps=3, state_dim=8, prefix_fold=prefix_fold, prefix_attention="mask")
    ref = make_policy("wam-ref", **kw)
    comp = make_policy("wam-ref", compile=True, compile_prefix=compile_prefix, **kw)
    wp._COMPILED.clear()
    for n in (1, 3):
        obs, seeds = _obs(n, seed=n, state_dim=8), list(range(n))
        np.testing.assert_allclose(comp.predict(obs, seeds), ref.predict(obs, seeds), rtol=1e-4, atol=1e-5)
    # what compile covers in the understanding tower: every vision layer whole (not its MLP again inside it), and
    # the text layers as the calls above ran them: two compiled functions, or the compiled rotary and MLP
    vis = comp.model.und.visual
    assert vis.blocks and all(getattr(b, "_compiled_call_impl", None) is not None for b in vis.blocks)
    assert all(getattr(b.mlp, "_compiled_call_impl", None) is None for b in vis.blocks)
    layers = compile_prefix == "layers"
    assert sorted(wp._COMPILED) == (["in", "out"] if layers else ["mlp"])
    assert (comp.engine.prefix_pass._rope is None) == layers and ref.engine.prefix_pass._rope is None
    with pytest.raises(UserError, match="compile_prefix"):
        make_policy("wam-ref", size="tiny", compile_prefix="whole")


@torch.no_grad()
@pytest.mark.parametrize("heads", [2, 4])   # K/V buffers with the kv heads as they are (folded) or repeated
def test_compiled_block_writes_kv_into_its_slots_only(one_thread, heads):
    """The compiled block before attention stores this step's K/V into the buffers' scratch slots itself (it is
    handed views of just those slots): the same output and slots as the eager block, and every prefix slot of the
    buffers left as it was, bit for bit."""
    from wamkit.policies.wam_ref.model import GenBlock, add_carry, split_carry
    torch.manual_seed(0)
    hidden, kvh, hd, s, n = 32, 2, 8, 6, 3
    blk = GenBlock(hidden, 64, 4, kvh, hd).eval()
    for b in (1, 3):   # the second size recompiles with a dynamic batch dimension
        x, tmod = torch.randn(b, n, hidden), torch.randn(b, 6, hidden)
        cos, sin = torch.randn(b, n, hd), torch.randn(b, n, hd)
        mask = torch.zeros(b, 1, 1, s + n)
        base_k, base_v = torch.randn(b, heads, s + n, hd), torch.randn(b, heads, s + n, hd)
        outs = {}
        for compiled in (False, True):
            blk.compiled = compiled
            blk.fold_gqa = heads == kvh
            k, v = base_k.clone(), base_v.clone()
            o = blk(x, tmod, cos, sin, k, v, mask, kv_room=True)
            # compiled, the block defers its MLP's residual to the next block (GenBlock.defers): added here
            assert isinstance(o, tuple) == compiled
            outs[compiled] = (add_carry(*split_carry(o)), k, v)
        (ref, rk, rv), (out, k, v) = outs[False], outs[True]
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        for got, want, base in ((k, rk, base_k), (v, rv, base_v)):
            torch.testing.assert_close(got[:, :, s:], want[:, :, s:], rtol=1e-4, atol=1e-5)
            assert torch.equal(got[:, :, :s], base[:, :, :s])
            assert not torch.equal(got[:, :, s:], base[:, :, s:])   # the slots were written


@torch.no_grad()
def test_compiled_block_returns_the_queries_folded(one_thread):
    """With fold_q (kv_layout=folded), the compiled block before attention returns q already folded (each kv
    head's query heads stacked along the query axis, contiguous: attention takes it with no copy in between), the
    same values as folding the eager block's q; and the folded attention over it gives the unfolded one's output."""
    from wamkit.policies.wam_ref import model as wm
    torch.manual_seed(1)
    hidden, heads, kvh, hd, s, n = 32, 4, 2, 8, 6, 3
    blk = wm.GenBlock(hidden, 64, heads, kvh, hd).eval()
    w = (blk.q_proj.weight, blk.k_proj.weight, blk.v_proj.weight)
    for b, w_qkv in ((1, w), (3, w), (2, torch.cat(w))):   # the training weights, then the fused inference ones
        x, tmod = torch.randn(b, n, hidden), torch.randn(b, 6, hidden)
        cos, sin = torch.randn(b, n, hd), torch.randn(b, n, hd)
        args = (x, tmod, blk.modulation, w_qkv, blk.q_norm.weight, blk.k_norm.weight, cos, sin, heads, kvh, hd,
                blk.eps)
        ref = wm._block_in(*args)
        q_ref = ref[0]
        for got in (wm._block_in(*args, fold_q=True), wm._compiled("in")(*args, fold_q=True)):
            q_fold = got[0]
            assert q_fold.shape == (b, kvh, heads // kvh * n, hd) and q_fold.is_contiguous()
            torch.testing.assert_close(q_fold, wm.fold_queries(q_ref, kvh), rtol=1e-4, atol=1e-5)
            for a, e in zip(got[1:], ref[1:]):   # k, v and the modulations as without the fold
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        # query head j of group g sits at rows (j % (heads // kvh)) * n ... of kv head j // (heads // kvh)
        torch.testing.assert_close(q_fold[:, 1, n:2 * n], q_ref[:, 3], rtol=1e-4, atol=1e-5)
        k, v = torch.randn(b, kvh, s + n, hd), torch.randn(b, kvh, s + n, hd)
        mask = torch.zeros(b, 1, 1, s + n)
        torch.testing.assert_close(wm.attend_folded(q_fold, k, v, mask, heads),
                                   wm.attend(q_ref, k, v, mask, fold=False), rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_compiled_blocks_defer_the_mlp_residual_to_the_next_blocks_norm(one_thread):
    """Compiled inference blocks hand their MLP's gated residual to the next block (GenBlock.defers), whose compiled
    function adds it in the kernel of its first norm: the tower's output equals the eager blocks' (each adding its
    own), every block but the first really takes a carry, and the compiled function with a carry has no more
    kernels than without one (the add shares the norm's kernel: no kernel of its own)."""
    import re
    from torch._inductor.utils import run_and_get_code
    from wamkit.policies.wam_ref import model as wm
    torch.manual_seed(2)
    hidden, heads, kvh, hd, s, n, b = 32, 4, 2, 8, 6, 3, 2
    blocks = torch.nn.ModuleList([wm.GenBlock(hidden, 64, heads, kvh, hd).eval() for _ in range(3)])
    x, tmod = torch.randn(b, n, hidden), torch.randn(b, 6, hidden)
    cos, sin = torch.randn(b, n, hd), torch.randn(b, n, hd)
    keys = [torch.randn(b, kvh, s + n, hd) for _ in blocks]
    values = [torch.randn(b, kvh, s + n, hd) for _ in blocks]
    mask = torch.zeros(b, 1, 1, s + n)
    tower = types.SimpleNamespace(blocks=blocks, norm_out=torch.nn.Identity(), action_out=torch.nn.Identity())
    prefix = types.SimpleNamespace(keys=keys, values=values)
    out_mod = torch.zeros(b, 2 * hidden)
    outs, carries = [], []
    for compiled in (False, True):
        for blk in blocks:
            blk.compiled = compiled
        assert all(blk.defers(True) == compiled for blk in blocks) and not blocks[0].defers(False)
        real = wm._block_in
        wm._COMPILED.clear()
        wm._block_in = lambda *a, **k: carries.append((compiled, k.get("carry") is not None)) or real(*a, **k)
        try:
            outs.append(wm.GenerationTower.run_blocks(tower, x, tmod, out_mod, cos, sin, prefix, mask, True, n))
        finally:
            wm._block_in = real
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    assert carries == [(False, False)] * 3 + [(True, False), (True, True), (True, True)]
    wm._COMPILED.clear()
    blk = blocks[0]
    args = (x, tmod, blk.modulation, torch.cat([blk.q_proj.weight, blk.k_proj.weight, blk.v_proj.weight]),
            blk.q_norm.weight, blk.k_norm.weight, cos, sin, heads, kvh, hd, blk.eps)
    kernels = []
    for carry in (None, (torch.randn(b, n, hidden), torch.randn(b, hidden))):
        torch._dynamo.reset()
        _, code = run_and_get_code(torch.compile(wm._block_in, fullgraph=True), *args, carry=carry)
        kernels.append(set(re.findall(r"cpp_fused_\w+", "\n".join(code))))
    assert len(kernels[0]) >= 1 and len(kernels[1]) == len(kernels[0]), kernels
    off = make_policy("wam-ref", size="tiny", compile=True, residual_carry=False)   # the option, for A/Bs
    assert not any(b.defers(True) for b in off.model.gen.blocks)
    assert all(b.defers(True) for b in make_policy("wam-ref", size="tiny", compile=True).model.gen.blocks)


def test_batched_vision_attention_matches_per_image_calls():
    """One SDPA call over all (equal-size) images = transformers' one call per image: same actions, and the
    vision tower's attention really is called once per layer, not once per image."""
    from wamkit.policies.wam_ref import model as wm

    per_image = make_policy("wam-ref", size="tiny", num_inference_steps=2, batched_vision_attention=False)
    batched = make_policy("wam-ref", size="tiny", num_inference_steps=2)
    assert batched.model.und.visual.config._attn_implementation == wm.VISION_ATTENTION
    assert per_image.model.und.visual.config._attn_implementation != wm.VISION_ATTENTION
    calls = []
    orig = wm.vision_attention_equal_length

    def counting(*a, **kw):
        calls.append(a[1].shape)
        return orig(*a, **kw)

    from transformers import AttentionInterface

    AttentionInterface.register(wm.VISION_ATTENTION, counting)
    try:
        obs = _obs(3, seed=4)
        np.testing.assert_allclose(batched.predict(obs, [1, 2, 3]), per_image.predict(obs, [1, 2, 3]),
                                   rtol=1e-5, atol=1e-6)
    finally:
        AttentionInterface.register(wm.VISION_ATTENTION, orig)
    depth = batched.qwen_config.vision_config.depth
    assert len(calls) == depth and all(c[2] == 3 * 2 * (64 // 8) ** 2 for c in calls)  # 3 obs x 2 cameras packed


def test_pixel_values_match_per_image_preprocessing():
    """The batched preprocessing (uint8 upload, one resize/normalize/patchify over all images) gives the same patches
    as the per-image recipe written out here: float / 255, antialiased bilinear resize, (x - mean) / std, and the
    Qwen-VL patch order (checked element by element for one patch)."""
    import torch.nn.functional as F

    from wamkit.policies.wam_ref.inputs import patchify

    pol = make_policy("wam-ref", size="tiny")
    rng = np.random.default_rng(3)
    # one batch resized / one batch already at image_size (patches laid out from the uint8 images) / mixed sizes
    for shapes in ([(96, 96)] * 3, [(64, 64)] * 3, [(64, 64), (80, 48)]):
        imgs = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
        ref = []
        for a in imgs:
            x = torch.from_numpy(a).permute(2, 0, 1).float() / 255.0
            if x.shape[1:] != (64, 64):
                x = F.interpolate(x[None], size=(64, 64), mode="bilinear", align_corners=False,
                                  antialias=True)[0].clamp_(0.0, 1.0)
            ref.append(patchify((x - 0.5) / 0.5, 8, 2, 2))
        torch.testing.assert_close(pol.inputs.pixel_values(imgs), torch.cat(ref), rtol=0, atol=0)
    # in bf16 too: the at-size path casts before the temporal repeat, the recipe after it
    bf = make_policy("wam-ref", size="tiny", dtype="bfloat16")
    imgs = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2)]
    ref = torch.cat([patchify((torch.from_numpy(a).permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5, 8, 2, 2)
                     for a in imgs]).to(torch.bfloat16)
    got = bf.inputs.pixel_values(imgs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # a stacked float32 batch (the training path hands tensors over as they are) is read, not normalized in place
    batch = torch.from_numpy(np.stack(imgs)).float()
    kept = batch.clone()
    torch.testing.assert_close(bf.inputs.pixel_values(batch), ref, rtol=0, atol=0)
    assert torch.equal(batch, kept)
    # patch order: patch 1 of image 0 is the merge window's second patch (row 0, column 1), channel 0 first
    img = torch.arange(3 * 16 * 16, dtype=torch.float32).reshape(3, 16, 16)
    p = patchify(img, 4, 2, 2)
    assert p.shape == (16, 3 * 2 * 16)
    torch.testing.assert_close(p[1, :16], img[0, 0:4, 4:8].reshape(-1))
    torch.testing.assert_close(p[1, 16:32], img[0, 0:4, 4:8].reshape(-1))   # the frame repeated (temporal 2)
    torch.testing.assert_close(p[2, :16], img[0, 4:8, 0:4].reshape(-1))


def test_config_normalizes_cli_strings_and_rejects_bad_values():
    """WamRefConfig: CLI strings become typed values; bad values fail naming the key; config= and kwargs build the
    same policy."""
    from wamkit.policies.wam_ref.config import WamRefConfig

    c = WamRefConfig(cameras="image,wrist_image", cuda_graphs="true", compile="false", horizon="8",
                     image_size="64", trainable_patterns=["gen.*", "und.*"], graph_buckets="4,1", max_batch_size=8)
    assert c.cameras == ("image", "wrist_image") and c.cuda_graphs is True and c.compile is False
    assert (c.horizon, c.image_size, c.trainable_patterns, c.buckets) == (8, 64, ("gen.*", "und.*"), (1, 4, 8))
    for bad, key in (({"kv_layout": "cat"}, "kv_layout"), ({"dtype": "int8"}, "dtype"), ({"size": "huge"}, "huge"),
                     ({"cuda_graphs": "maybe"}, "cuda_graphs")):
        with pytest.raises(UserError, match=key):
            WamRefConfig(**bad)
    from wamkit.policies.wam_ref.policy import WamRefPolicy

    a = WamRefPolicy(config=WamRefConfig(size="tiny", horizon=8, num_inference_steps=2))
    b = make_policy("wam-ref", size="tiny", horizon="8", num_inference_steps=2)
    assert a.spec == b.spec and a.export_config() == b.export_config()
    np.testing.assert_array_equal(a.predict(_obs(2), [3, 4]), b.predict(_obs(2), [3, 4]))


def test_a_collated_training_batch_gives_the_inputs_of_per_observation_lists():
    """prepare_inputs with {camera: (B, H, W, 3)} tensors and a (B, state_dim) state tensor (a training batch: one
    stack, no per-observation split) equals the per-observation lists path, tensor for tensor."""
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8)
    obs = _obs(3, state_dim=8)
    ref = pol.prepare_inputs([o.images for o in obs], TASKS[:3], [o.state for o in obs])
    cams = list(obs[0].images)
    batch = {c: torch.from_numpy(np.stack([o.images[c] for o in obs])) for c in cams}
    got = pol.prepare_inputs(batch, TASKS[:3], torch.from_numpy(np.stack([o.state for o in obs])))
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)


def test_a_replica_predicts_the_same_actions_at_the_same_time(one_thread):
    """replica() (the server's concurrent_batches): the same model and fused weights, its own engine (graphs,
    buffers); the original and the replica predicting in two threads at once give what each gives alone."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    # the cycles the compile tests before this one left (Dynamo guards, Inductor kernels) are freed here, in the main
    # thread, not by a collection that starts inside a predict thread (CI hung once in this test, GIL held)
    gc.collect()
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8, compile=False)
    twin = pol.replica()
    assert twin.engine is not pol.engine and twin.model is pol.model
    assert twin.engine.weights is pol.engine.weights and twin.engine._graphs is not pol.engine._graphs
    a_obs, b_obs = _obs(3, seed=5, state_dim=8), _obs(2, seed=6, state_dim=8)
    alone_a, alone_b = pol.predict(a_obs, [1, 2, 3]), twin.predict(b_obs, [4, 5])
    with ThreadPoolExecutor(2) as ex:
        for _ in range(3):
            fa = ex.submit(pol.predict, a_obs, [1, 2, 3])
            fb = ex.submit(twin.predict, b_obs, [4, 5])
            np.testing.assert_allclose(fa.result(), alone_a, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(fb.result(), alone_b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pol.predict(b_obs, [4, 5]), alone_b, rtol=1e-5, atol=1e-6)


def test_an_export_keeps_its_horizon_and_eval_cuts_its_chunk(tmp_path):
    """A probe's finding: `wamkit eval policy=<export> horizon=4` rebuilt the 16-step network with 4 action tokens
    (horizon changes no weight shape, so it loaded), and scored a model nobody trained: its actions differed from
    the trained chunk's first 4 by up to 8.6 on actions of ~15. Now an export refuses another horizon, eval builds
    it as exported, and the chunk is cut (docs/evaluation.md), as `wamkit serve action_horizon=` did."""
    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.runner import policy_kwargs

    pol = make_policy("wam-ref", size="tiny", num_inference_steps=1, init_seed=3)
    out = pol.save_pretrained(tmp_path / "export")
    with pytest.raises(UserError, match=r"horizon=4 would change the exported network \(saved: horizon=16\)"):
        make_policy(str(out), horizon=4)
    cfg = load_config(EvalConfig, None, ["env=metaworld", f"policy={out}", "horizon=4"])
    kw = policy_kwargs(cfg, pol.spec.action.dim)
    assert "horizon" not in kw and make_policy(str(out), **kw).spec.action.horizon == 16
    cfg = load_config(EvalConfig, None, ["env=metaworld", "policy=wam-ref", "horizon=4"])
    assert policy_kwargs(cfg, 7)["horizon"] == 4   # a policy built fresh takes the horizon asked for
