"""wam-ref's fused inference path on the CPU: fused q/k/v and gate/up GEMMs, the host-sync-free prefix pass, the
CUDA-graph plumbing (static buffers, buckets, prefix graph feeding the denoising graph) run eagerly, and that none of
it leaks into training (parameters, state dict, loss, gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies import make_policy

TASKS = ["put the bowl on the plate", "open the top drawer and put the bowl inside", "pick up the ketchup"]


def _obs(n: int, seed: int = 0, state_dim: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    return [Observation({c: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for c in ("image", "wrist_image")},
                        rng.standard_normal(state_dim).astype(np.float32) if state_dim else None,
                        TASKS[i % len(TASKS)]) for i in range(n)]


def _inputs(pol, n=3, seed=0):
    obs = _obs(n, seed, pol.state_dim)
    return pol.prepare_inputs([o.images for o in obs], [o.task for o in obs],
                              [o.state for o in obs] if pol.state_dim else None)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_fused_predict_matches_reference(dtype, tol):
    """fused=true (one GEMM for q/k/v and for gate/up, prefix.PrefixPass) vs fused=false (transformers' forward,
    one GEMM per projection): the same actions within fp32 rounding (bf16: within bf16 rounding, atol 2e-2 on
    actions of magnitude ~1-3)."""
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=3, state_dim=8, dtype=dtype)
    obs, seeds = _obs(3, 1, 8), [4, 5, 6]
    assert pol.fused
    fused = pol.predict(obs, seeds)
    pol.fused = False
    ref = pol.predict(obs, seeds)
    np.testing.assert_allclose(fused, ref, rtol=tol, atol=tol)
    assert np.abs(ref).max() > 0.1   # not trivially zero


@torch.no_grad()
@pytest.mark.parametrize("prefix_attention", ["mask", "causal"])
def test_prefix_pass_matches_transformers_forward(prefix_attention):
    """prefix.PrefixPass (vision geometry precomputed, image slots by slicing, decoder layers run by hand) gives
    transformers' per-layer K/V, key mask and next positions, with and without fused weights. prefix_attention=
    causal (no padding mask) gives them at every valid position; a padded position's K/V, which the loop's key mask
    hides, may differ (there, and only there, the two do differ)."""
    pol = make_policy("wam-ref", size="tiny", max_text_len=20, prefix_attention=prefix_attention)
    inp = _inputs(pol)
    assert inp["attention_mask"].sum(1).unique().numel() > 1    # prompts of different lengths (padding masked)
    ref = pol.model.encode_prefix(inp["input_ids"], inp["attention_mask"], inp["mm_token_type_ids"],
                                  inp["pixel_values"], inp["image_grid_thw"], inp["position_ids"])
    valid = ref.key_mask[:, None, :, None].expand_as(ref.keys[-1])
    for fw in (None, pol.engine.weights.get()):
        p = pol.engine.prefix_pass(inp, fw)
        assert len(p.keys) == len(ref.keys)
        for k, rk, v, rv in zip(p.keys, ref.keys, p.values, ref.values):
            torch.testing.assert_close(k[valid], rk[valid], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[valid], rv[valid], rtol=1e-5, atol=1e-5)
        padded = (p.keys[-1] - ref.keys[-1]).abs()[~valid].max()
        assert (padded > 1e-3) if prefix_attention == "causal" else (padded < 1e-5)
        assert torch.equal(p.key_mask, ref.key_mask) and torch.equal(p.next_pos, ref.next_pos)


@torch.no_grad()
def test_one_denoising_step_fused_matches_unfused():
    pol = make_policy("wam-ref", size="tiny", state_dim=8)
    inp = _inputs(pol)
    p = pol.engine.encode(inp, None).with_room(pol.gen_tokens, pol.engine.kv_heads())
    x = pol.noise([1, 2, 3])
    fw = pol.engine.weights.get()
    ref = pol.model.gen.denoise(p, x, inp["state"], 1)
    out = pol.model.gen.denoise(p, x, inp["state"], 1, fused=fw.gen)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, x)


@torch.no_grad()
def test_fused_weights_follow_the_parameters():
    """The fused copies are derived state: an in-place weight change (optimizer step, load_state_dict) is seen at
    the next predict; a rebuild with the same shapes reuses the fused tensors (CUDA graphs stay valid)."""
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2)
    obs, seeds = _obs(2), [1, 2]
    before = pol.predict(obs, seeds)
    fw = pol.engine.weights
    ptrs = [w.data_ptr() for pair in fw.gen for w in pair]
    gen0 = fw.storage_generation
    pol.model.gen.blocks[0].up_proj.weight.mul_(3.0)
    pol.model.und.language_model.layers[0].self_attn.k_proj.weight.mul_(0.5)
    after = pol.predict(obs, seeds)
    assert not np.allclose(after, before)
    pol.fused = False
    np.testing.assert_allclose(after, pol.predict(obs, seeds), rtol=1e-5, atol=1e-5)
    assert [w.data_ptr() for pair in fw.gen for w in pair] == ptrs and fw.storage_generation == gen0
    pol.fused = True
    pol.model.load_state_dict(make_policy("wam-ref", size="tiny").model.state_dict())
    np.testing.assert_allclose(pol.predict(obs, seeds), before, rtol=1e-5, atol=1e-5)


def test_fusion_does_not_leak_into_training():
    """After inference has built the fused weights: the same parameters, state-dict keys, loss and gradients as a
    policy that never ran inference (training uses the model's own q/k/v/gate/up weights)."""
    def loss_and_grads(pol):
        torch.manual_seed(0)
        pol.model.train()
        obs = _obs(4, 3)
        batch = {"images": [o.images for o in obs], "task": [o.task for o in obs],
                 "actions": np.random.default_rng(0).uniform(-1, 1, (4, pol.horizon, pol.model_action_dim))}
        loss, _ = pol.sft_loss(batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in pol.model.named_parameters() if p.grad is not None}

    plain = make_policy("wam-ref", size="tiny", num_inference_steps=2)
    used = make_policy("wam-ref", size="tiny", num_inference_steps=2)
    used.predict(_obs(2), [0, 1])
    assert used.engine.weights.gen                                     # fusion was built
    assert list(used.model.state_dict()) == list(plain.model.state_dict())
    assert [n for n, _ in used.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    l1, g1 = loss_and_grads(plain)
    l2, g2 = loss_and_grads(used)
    assert torch.equal(l1, l2) and g1.keys() == g2.keys() and len(g1) > 0
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n


@pytest.mark.parametrize("prefix_graphs", [True, False])
def test_graph_plumbing_matches_eager(prefix_graphs):
    """The CUDA-graph path's plumbing run eagerly (engine.emulate_graphs: the captured functions are called at
    each replay): batches padded to a bucket, inputs through static buffers, the prefix graph writing the K/V into
    the denoising graph's buffers. Same actions as the plain eager path, for two batch sizes sharing a bucket and
    a smaller one after a larger (rows past the batch hold stale values)."""
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8, max_batch_size=8,
                      cuda_graphs=True, prefix_graphs=prefix_graphs)
    obs, seeds = _obs(5, 2, 8), [3, 1, 4, 1, 5]
    eager = pol.predict(obs, seeds)            # on the CPU cuda_graphs alone changes nothing
    pol.engine.emulate_graphs = True
    for n in (5, 3, 1, 5):
        np.testing.assert_allclose(pol.predict(obs[:n], seeds[:n]), eager[:n], rtol=1e-5, atol=1e-5)
    assert sorted(k[0] for k in pol.engine._graphs) == [1, 4, 8]
    assert (sorted(k[0] for k in pol.engine._prefix_graphs) == [1, 4, 8]) == prefix_graphs
    assert not pol.engine.prefix_graph_errors


@torch.no_grad()
def test_prefix_pass_and_denoise_read_no_device_data_on_the_host():
    """What a CUDA graph capture needs: once the vision geometry is computed (host work, once per image count),
    the prefix pass and the denoising loop never read tensor values on the host (.item(), .tolist(), boolean
    masks, nonzero). Checked by running them on the meta device, where any such read raises (transformers' own
    forward does not get through)."""
    import copy

    from wamkit.policies.wam_ref.fused import FusedWeights
    from wamkit.policies.wam_ref.prefix import PrefixPass

    pol = make_policy("wam-ref", size="tiny", state_dim=8)
    inp = _inputs(pol, 2)
    pol.engine.prefix_pass(inp)                       # computes the geometry for 2 x 2 images on the CPU
    meta = copy.deepcopy(pol.model).to("meta")
    mp = PrefixPass(meta, pol.engine.prefix_pass.image_slots)
    for (n, grid, _), geo in pol.engine.prefix_pass._geometry.items():
        mp._geometry[(n, grid, "meta")] = {k: v.to("meta") if k in ("interp_indices", "interp_weights",
                                                                     "position_ids") else v for k, v in geo.items()}
    minp = {k: v.to("meta") for k, v in inp.items()}
    fw = FusedWeights(meta).get()
    for w in (fw, None):
        p = mp(minp, w)
        assert p.keys[0].device.type == "meta" and len(p.keys) == len(meta.gen.blocks)
        room = p.with_room(pol.gen_tokens, pol.engine.kv_heads())
        x = torch.zeros(2, pol.horizon, pol.model_action_dim, device="meta")
        out = meta.gen.denoise(room, x, minp["state"], 3, None if w is None else w.gen)
        assert out.shape == x.shape


def test_failed_prefix_capture_falls_back_to_the_eager_prefix(monkeypatch):
    """A prefix graph whose capture raises leaves that bucket's prefix eager (a warning, the reason kept in
    engine.prefix_graph_errors); the actions are the same and the denoising graph still runs."""
    from wamkit.policies.wam_ref import engine as eng_mod

    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2, max_batch_size=4, cuda_graphs=True)
    obs, seeds = _obs(3, 4), [7, 8, 9]
    eager = pol.predict(obs, seeds)
    pol.engine.emulate_graphs = True
    monkeypatch.setattr(eng_mod, "_PrefixGraph", broken)
    with pytest.warns(UserWarning, match="prefix CUDA graph"):
        out = pol.predict(obs, seeds)
    np.testing.assert_allclose(out, eager, rtol=1e-5, atol=1e-5)
    assert [k[0] for k in pol.engine.prefix_graph_errors] == [4] and [k[0] for k in pol.engine._graphs] == [4]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the failure is remembered: no second capture attempt, no second warning
        np.testing.assert_allclose(pol.predict(obs, seeds), eager, rtol=1e-5, atol=1e-5)


# ---- gemm=cublas|triton|autotune (skinny.py) and the precomputed attention mask ----------------------------------

def test_gemm_option_is_parsed_and_reaches_every_block():
    from wamkit.core.errors import UserError
    from wamkit.policies.wam_ref.config import WamRefConfig

    assert WamRefConfig().gemm == "cublas"
    assert WamRefConfig(gemm="Triton").gemm == "triton"          # CLI strings, any case
    with pytest.raises(UserError, match="gemm"):
        WamRefConfig(gemm="cutlass")
    pol = make_policy("wam-ref", size="tiny", gemm="triton")
    assert pol.gemm == "triton" and {b.gemm for b in pol.model.gen.blocks} == {"triton"}
    pol.gemm = "autotune"
    assert {b.gemm for b in pol.model.gen.blocks} == {"autotune"}
    with pytest.raises(ValueError, match="gemm"):
        pol.gemm = "bogus"


def test_gemm_cublas_is_the_default_path_bit_for_bit():
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8)
    explicit = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8, gemm="cublas")
    obs, seeds = _obs(3, 5, 8), [1, 2, 3]
    assert np.array_equal(pol.predict(obs, seeds), explicit.predict(obs, seeds))


@torch.no_grad()
def test_additive_mask_is_what_sdpa_builds_from_the_boolean_mask():
    """The denoising loop passes SDPA a float mask built once (model.additive_mask) instead of the boolean key mask:
    the same attention, bit for bit, on the CPU (SDPA's own conversion gives the same -inf / 0 values)."""
    from wamkit.policies.wam_ref.model import additive_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 32, generator=g) for n in (5, 9, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 3:6] = False
    mask[1, :2] = False
    add = additive_mask(mask, torch.float32)
    assert add.shape == (2, 1, 1, 9) and add.dtype == torch.float32
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=add)
    assert torch.equal(out, ref)
    assert not torch.equal(ref, torch.nn.functional.scaled_dot_product_attention(q, k, v))   # the mask matters


def test_gemm_triton_without_a_usable_kernel_is_cublas():
    """gemm=triton where the kernel cannot run (no Triton, or no CUDA device and no TRITON_INTERPRET=1): the loop
    falls back to F.linear, so the actions are those of gemm=cublas exactly."""
    from wamkit.policies.wam_ref import skinny

    ok, why = skinny.available()
    if ok:
        pytest.skip("the Triton kernel can run here (the interpreter test below covers it)")
    assert why
    obs, seeds = _obs(2, 6), [7, 8]
    ref = make_policy("wam-ref", size="tiny", num_inference_steps=2).predict(obs, seeds)
    assert np.array_equal(make_policy("wam-ref", size="tiny", num_inference_steps=2, gemm="triton").predict(obs, seeds),
                          ref)


def _interpreted_triton():
    from wamkit.policies.wam_ref import skinny

    if skinny.triton is None:
        pytest.skip("triton does not import here (CPU torch): the skinny kernel is tested with TRITON_INTERPRET=1 "
                    "in an environment that has triton, and on the GPU by bench/device/bench_gemm.py")
    if not skinny.interpreting() and not torch.cuda.is_available():
        pytest.skip("no CUDA device: run with TRITON_INTERPRET=1 to test the kernel in Triton's interpreter")
    return skinny


@pytest.mark.parametrize("m,n,k", [(16, 256, 512), (5, 96, 160), (17, 128, 256), (64, 128, 128)])
def test_skinny_matmul_matches_matmul(m, n, k):
    """The split-K kernel against x @ w.T in fp32 (interpreter: fp32 and fp16; Triton's interpreter gets bf16 dots
    wrong, so bf16 is the GPU bench's check), for the heuristic config and ones with uneven / several K splits."""
    skinny = _interpreted_triton()
    dev = "cuda" if torch.cuda.is_available() and not skinny.interpreting() else "cpu"
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g).to(dev), torch.randn(n, k, generator=g).to(dev)
    ref = x @ w.T
    for cfg in (None, skinny.SkinnyConfig(32, 32, 1, 4, 2), skinny.SkinnyConfig(32, 32, 3, 4, 2),
                skinny.SkinnyConfig(16, 16, 4, 4, 2)):
        if dev == "cpu":
            torch.testing.assert_close(skinny.skinny_matmul(x, w, cfg), ref, rtol=1e-5, atol=1e-4)
        y = skinny.skinny_matmul(x.half(), w.half(), cfg)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.float(), x.half().float() @ w.half().float().T, rtol=2e-3, atol=5e-2)


@pytest.mark.parametrize("b,n,f,h", [(1, 16, 256, 128), (3, 5, 96, 64)])
def test_skinny_swiglu_down_matches_torch(b, n, f, h):
    """wamkit::skinny_swiglu_down (SwiGLU prologue, gated-residual epilogue, with and without K splits) = the
    generation block's x + g2 * down(silu(g) * u)."""
    skinny = _interpreted_triton()
    dev = "cuda" if torch.cuda.is_available() and not skinny.interpreting() else "cpu"
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(b * n)
    gu, w = torch.randn(b, n, 2 * f, generator=g), torch.randn(h, f, generator=g) * 0.1
    x, g2 = torch.randn(b, n, h, generator=g), torch.randn(b, h, generator=g)
    gu, w, x, g2 = (t.to(dev, dt) for t in (gu, w, x, g2))
    gg, uu = gu.float().split(f, dim=-1)
    ref = x.float() + g2.float()[:, None] * ((torch.nn.functional.silu(gg) * uu) @ w.float().T)
    for cfg in (skinny.SkinnyConfig(32, 32, 1, 4, 2), skinny.SkinnyConfig(32, 32, 3, 4, 2)):
        skinny.set_config(b * n, h, f, cfg)
        try:
            out = skinny.skinny_swiglu_down(gu, w, x, g2)
        finally:
            skinny._TUNED.clear()
        assert out.shape == x.shape and out.dtype == dt
        torch.testing.assert_close(out.float(), ref, rtol=1e-5 if dt == torch.float32 else 2e-2,
                                   atol=1e-4 if dt == torch.float32 else 5e-2)


def test_gemm_triton_predict_matches_cublas():
    """The whole policy with gemm=triton (every loop GEMM through the kernel: 3 x 17 rows <= 64) against
    gemm=cublas, fp32 on the CPU through Triton's interpreter."""
    skinny = _interpreted_triton()
    if not skinny.interpreting():
        pytest.skip("fp32 end-to-end check runs in the interpreter; on GPUs bench_nano --check compares bf16")
    obs, seeds = _obs(3, 7, 8), [1, 2, 3]
    ref = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8).predict(obs, seeds)
    calls = []
    orig = skinny.skinny_matmul
    skinny.skinny_matmul = lambda *a, **k: calls.append(k.get("swiglu", False)) or orig(*a, **k)
    try:
        out = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8, gemm="triton").predict(obs, seeds)
    finally:
        skinny.skinny_matmul = orig
    assert len(calls) == 2 * 4 * 4          # steps x blocks x (qkv, o, gate_up, down)
    assert sum(calls) == 2 * 4              # down: SwiGLU + down projection + gated residual in one kernel
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def _training_call(pol, n=4, seed=0):
    """A training forward's arguments: model inputs of n prompts of different lengths, actions, noise, t."""
    inp = _inputs(pol, n, seed)
    g = torch.Generator().manual_seed(seed)
    actions = torch.randn(n, pol.horizon, pol.model_action_dim, generator=g)
    return dict(inp, actions=actions, action_mask=torch.ones(n, pol.horizon, dtype=torch.bool),
                noise=torch.randn(actions.shape, generator=g), t=torch.rand(n, generator=g))


def test_static_training_prefix_matches_transformers_forward():
    """The training forward's static prefix (model.encode_prefix_static: vision geometry cached, image and DeepStack
    features placed by index) gives transformers' loss and the same gradients for every parameter, the
    understanding tower's included, as the forward through transformers' Qwen3VLModel."""
    pol = make_policy("wam-ref", size="tiny", max_text_len=20, state_dim=8)
    pol.apply_trainable_patterns(["*"])
    m = pol.module
    assert m.image_slots == pol.inputs.image_slots
    call = _training_call(pol)
    assert call["attention_mask"].sum(1).unique().numel() > 1    # padded prompts of different lengths
    out = {}
    for static in (False, True):
        m.zero_grad(set_to_none=True)
        loss = m(**call, static_prefix=static).mean()
        loss.backward()
        out[static] = loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    (ref, gref), (got, ggot) = out[False], out[True]
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert set(ggot) == set(gref) and any(n.startswith("und.visual.") for n in gref)
    for n in gref:
        torch.testing.assert_close(ggot[n], gref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_static_training_prefix_is_one_graph_with_no_host_reads():
    """What the training step needs to keep the host ahead of the GPU: the static prefix's forward reads no device
    data on the host (.tolist, .item, boolean masks, nonzero: each a graph break), so torch.compile captures the
    whole training forward as one graph (transformers' forward: 29 graph breaks here and on the H200, session 9)."""
    pol = make_policy("wam-ref", size="tiny", max_text_len=20, state_dim=8)
    pol.apply_trainable_patterns(["*"])
    m = pol.module
    call = _training_call(pol)
    m.static_vision_kwargs(call["input_ids"].shape[0], call["input_ids"].device)   # what sft_loss does first
    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(m)(**call, static_prefix=True)
    finally:
        torch._dynamo.reset()
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [r.reason.splitlines()[0] for r in ex.break_reasons]


@torch.no_grad()
def test_prefix_fold_gives_the_prefix_of_the_expanded_attention():
    """prefix_fold=true (the text layers' grouped-query attention folded, the causal mask tiled per stacked head)
    gives the same K/V and actions as the expanded path, and really takes the folded path (its tiled mask is
    built, rep x S query rows)."""
    from wamkit.policies.wam_ref import prefix as prefix_mod

    kw = dict(size="tiny", num_inference_steps=2, state_dim=8, prefix_attention="mask")   # the fold's attention
    plain = make_policy("wam-ref", prefix_fold=False, **kw)
    folded = make_policy("wam-ref", **kw)   # prefix_fold=true: the default
    folded.model.load_state_dict(plain.model.state_dict())
    obs = [Observation({c: np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
                        for c in plain.cameras}, np.zeros(8, np.float32), f"task {i}") for i in range(3)]
    masks = []
    real = prefix_mod.PrefixPass._fold_mask

    def spy(self, attn_mask, attn):
        m = real(self, attn_mask, attn)
        masks.append(None if m is None else tuple(m.shape))
        return m

    prefix_mod.PrefixPass._fold_mask = spy
    try:
        a, b = plain.predict(obs, [1, 2, 3]), folded.predict(obs, [1, 2, 3])
    finally:
        prefix_mod.PrefixPass._fold_mask = real
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    tc = plain.engine.text_config
    rep, s = tc.num_attention_heads // tc.num_key_value_heads, plain.prefix_len
    assert rep > 1 and masks == [None, (3, 1, rep * s, s)]


@torch.no_grad()
@pytest.mark.parametrize("compiled", [False, True])
def test_causal_prefix_attention_gives_the_masked_prefix(compiled):
    """prefix_attention=causal (causal SDPA with no mask, GQA in the kernel) gives the actions of the causal +
    padding mask for prompts of different lengths (right-padded: a valid token never sees a padded one), on the
    prefix pass's module-by-module path and its compiled layers (compile_prefix=layers), and builds no mask."""
    from wamkit.policies.wam_ref import prefix as prefix_mod

    kw = dict(size="tiny", num_inference_steps=2, state_dim=8, compile=compiled)
    masked = make_policy("wam-ref", prefix_attention="mask", **kw)
    causal = make_policy("wam-ref", **kw)   # prefix_attention=causal: the default
    causal.model.load_state_dict(masked.model.state_dict())
    tasks = ["pick", "open the top drawer and put the bowl inside", "push the plate to the front of the stove"]
    obs = [Observation({c: np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
                        for c in masked.cameras}, np.zeros(8, np.float32), t) for i, t in enumerate(tasks)]
    _, text_mask = masked.inputs.tokenizer.encode_fixed(tasks, masked.inputs.max_text_len)
    assert not text_mask.all()   # padding present: the case where the two could differ
    built = []
    real = prefix_mod.PrefixPass._fold_mask
    prefix_mod.PrefixPass._fold_mask = lambda self, *a: built.append(1) or real(self, *a)
    try:
        a, b = masked.predict(obs, [1, 2, 3]), causal.predict(obs, [1, 2, 3])
    finally:
        prefix_mod.PrefixPass._fold_mask = real
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert built == [1]   # the masked policy's call only
    with pytest.raises(UserError, match="prefix_attention must be one of mask, causal"):
        make_policy("wam-ref", size="tiny", prefix_attention="none")
