"""The understanding tower's inference pass (images + prompt -> per-layer K/V, a `Prefix`) with no host
synchronisation, so that a CUDA graph can capture it, and with fused q/k/v and gate/up GEMMs.

Same arithmetic as `WamRefModel.encode_prefix` (transformers' `Qwen3VLModel.forward` with `use_cache=True`;
tests/test_policy_wam_ref.py compares the two), built from the same modules. What transformers does on the host per
call is done once per image count here or replaced by what this prompt layout makes static:
- the vision geometry (patch position ids, position-embedding interpolation taps, attention boundaries) depends only
  on the image count (all images share one size): computed once per count and handed to the vision tower through
  the precomputed-kwargs hooks of `transformers.vision_utils` (cu_seqlens stays on the host: only its length and the
  Python-int max_seqlen are read);
- the image tokens sit at the same slots of every prompt (`[<vision_start> <image_pad>*n <vision_end>]` per camera):
  the image embeddings and DeepStack features go in by slicing, not through a boolean mask (a host sync);
- the decoder layers run here (norms and attention modules called as they are), so the K/V come out directly instead
  of through a cache object, the causal + padding mask is built on the device, and q/k/v and gate/up can be fused;
  compiled (compile_prefix=layers), each layer runs as two pure functions of its tensors around attention, _text_in
  and _text_out, with the same arithmetic (the residual adds fused into the norms, q written where attention reads
  it, no eager copies between them).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from wamkit.policies.wam_ref.fused import FusedWeights, TextLayerWeights
from wamkit.policies.wam_ref.model import Prefix, _rope, vision_geometry


class PrefixPass:
    """Callable: model inputs (as InputProcessor.prepare builds them) -> Prefix.

    image_slots: (start, length) of each camera's image tokens in the prompt, in camera order."""

    def __init__(self, model, image_slots: list[tuple[int, int]]):
        self.model = model
        self.image_slots = list(image_slots)
        self._geometry: dict[tuple, dict] = {}
        self.compiled = False        # compile=true (InferenceEngine.enable_compile)
        self.compile_as = "layers"   # compiled, with fused weights: each text layer as two compiled functions around
                                     # attention (layers: _text_in, _text_out) or module by module (modules)
        self._rope = None            # modules: transformers' rotary embedding, compiled
        self.fold = False            # prefix_fold: grouped-query text attention folded (_fold_mask)
        self.causal = False          # prefix_attention=causal: causal SDPA without a mask, GQA in the kernel (valid
                                     # for right-padded prompts: a valid token never attends to a padded one; _sdpa)

    # ------------------------------------------------------------------ vision geometry (host work, once per count)
    def geometry(self, n_images: int, grid: tuple[int, int, int], device: torch.device) -> dict:
        """The vision tower's precomputed kwargs for n_images images of grid (t, h, w) patches (model.vision_geometry,
        cached per count)."""
        key = (n_images, grid, str(device))
        geo = self._geometry.get(key)
        if geo is None:
            geo = self._geometry[key] = vision_geometry(self.model.und.visual, n_images, grid, device)
        return geo

    # ------------------------------------------------------------------ the pass
    def __call__(self, inputs: dict[str, torch.Tensor], fused: FusedWeights | None = None) -> Prefix:
        und = self.model.und
        vis = und.visual
        ids, mask, pos = inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"]
        b = ids.shape[0]
        cams = len(self.image_slots)
        tokens = self.image_slots[0][1]
        merge = vis.config.spatial_merge_size
        side = int(round((tokens * merge * merge) ** 0.5))   # every image: tokens * merge^2 patches, square
        grid = (1, side, side)
        geo = self.geometry(b * cams, grid, ids.device)
        out = vis(inputs["pixel_values"].to(vis.dtype), grid_thw=geo["grid_thw"],
                  **{k: v for k, v in geo.items() if k != "grid_thw"})
        pooled = out.pooler_output.view(b, cams, tokens, -1)
        deep = [f.view(b, cams, tokens, -1) for f in out.deepstack_features]

        lm = und.language_model
        h = lm.embed_tokens(ids)
        for c, (start, n) in enumerate(self.image_slots):
            h[:, start:start + n] = pooled[:, c].to(h.dtype)
        cos, sin = lm.rotary_emb(h, pos)
        valid = mask.bool()
        attn_mask = fold_mask = None   # causal (prefix_attention=causal): no mask at all
        if not self.causal:
            s = ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
            attn_mask = causal[None, None] & valid[:, None, None, :]
            fold_mask = self._fold_mask(attn_mask, lm.layers[0].self_attn)
        keys, values = [], []
        rope = sys.modules[type(lm.layers[0].self_attn).__module__].apply_rotary_pos_emb   # transformers'
        if self.compiled and self.compile_as == "modules":
            # transformers' rotate-half rotary embedding is five eager kernels on q and five on k per layer
            # (a cat among them): one fused kernel each once compiled (a pure function: one compile for all layers)
            rope = self._rope = self._rope or torch.compile(rope)
        for i, layer in enumerate(lm.layers):
            fw = fused.text[i] if fused is not None else None
            swiglu = fw is not None and getattr(layer.mlp.config, "hidden_act", "silu") == "silu"
            if swiglu and self.compiled and self.compile_as == "layers":
                h, k, v = self._compiled_layer(layer, h, cos, sin, attn_mask, fold_mask, fw)
            else:   # the modules one by one, as transformers runs them (the MLP's gate/up fused where it is SwiGLU)
                a, k, v = _text_attention(layer.self_attn, layer.input_layernorm(h), cos, sin, attn_mask, fw, rope,
                                          fold_mask)
                h = h + a
                x = layer.post_attention_layernorm(h)
                if swiglu:
                    mlp = _compiled_text("mlp") if self.compiled else _text_mlp
                    h = h + mlp(x, fw.gate_up, layer.mlp.down_proj.weight)
                else:   # training weights, or an MLP that is not SwiGLU
                    h = h + layer.mlp(x)
            if i < len(deep):
                for c, (start, n) in enumerate(self.image_slots):
                    h[:, start:start + n] += deep[i][:, c].to(h.dtype)
            keys.append(k)
            values.append(v)
        next_pos = pos.masked_fill(~valid[None], -1).amax(dim=(0, 2)) + 1
        return Prefix(keys=keys, values=values, key_mask=valid, next_pos=next_pos)

    def _compiled_layer(self, layer, h, cos, sin, attn_mask, fold_mask, fw: TextLayerWeights):
        """One text layer with fused q/k/v and gate/up weights and a SwiGLU MLP -> (h, k, v), as compile_as=layers
        runs it: _text_in and _text_out compiled, attention between them, so that Inductor fuses the norms with the
        residual adds, q/k norms with the rotary embedding (q written folded where attention reads it), and the
        output's transpose with what follows."""
        attn = layer.self_attn
        cfg = attn.config
        heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        fold = fold_mask is not None and heads > kv_heads
        q, k, v = _compiled_text("in")(h, layer.input_layernorm.weight, fw.qkv, fw.qkv_bias, attn.q_norm.weight,
                                       attn.k_norm.weight, cos, sin, heads, kv_heads, hd,
                                       layer.input_layernorm.variance_epsilon, fold)
        if fold:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=fold_mask, scale=attn.scaling)
        else:
            o = _sdpa(q, k, v, attn_mask, attn.scaling)
        h = _compiled_text("out")(h, o, attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                                  fw.gate_up, layer.mlp.down_proj.weight, hd,
                                  layer.post_attention_layernorm.variance_epsilon)
        return h, k, v

    def _fold_mask(self, attn_mask: torch.Tensor, attn) -> torch.Tensor | None:
        """With fold (wam-ref's prefix_fold) and grouped-query attention, the text layers' attention runs folded as
        the loop's does with kv_layout=folded (model.attend): each kv head's query heads stacked along the query
        axis, over the kv heads' K/V, with no K/V repeated to every query head. The causal mask then holds one copy
        per stacked head: (B, 1, rep x S, S), built once for all layers. None: the expanded path."""
        heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
        if heads == kv_heads or not self.fold:
            return None
        b, _, s, _ = attn_mask.shape
        rep = heads // kv_heads
        return attn_mask[:, :, None].expand(b, 1, rep, s, s).reshape(b, 1, rep * s, s)


def _text_attention(attn, x, cos, sin, mask, fw: TextLayerWeights | None, rope, fold_mask=None):
    """transformers' Qwen3-VL text attention (q/k norms, mRoPE, SDPA over the masked prefix), returning its
    post-rotary K and V (what the cache would hold); one [q; k; v] GEMM when fw is given. rope: transformers'
    apply_rotary_pos_emb of that module, or a compiled copy of it. fold_mask (PrefixPass._fold_mask): the folded
    grouped-query attention over that mask instead of K/V repeated to every query head (the same scores)."""
    b, s, _ = x.shape
    hd = attn.head_dim
    if fw is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        nq, nkv = attn.q_proj.out_features, attn.k_proj.out_features
        q, k, v = F.linear(x, fw.qkv, fw.qkv_bias).split((nq, nkv, nkv), dim=-1)
    q = attn.q_norm(q.view(b, s, -1, hd)).transpose(1, 2)
    k = attn.k_norm(k.view(b, s, -1, hd)).transpose(1, 2)
    v = v.view(b, s, -1, hd).transpose(1, 2)
    q, k = rope(q, k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    if fold_mask is not None and rep > 1:
        kvh = k.shape[1]
        o = F.scaled_dot_product_attention(q.reshape(b, kvh, rep * s, hd), k, v, attn_mask=fold_mask,
                                           scale=attn.scaling)
        return attn.o_proj(o.reshape(b, kvh * rep, s, hd).transpose(1, 2).reshape(b, s, -1)), k, v
    o = _sdpa(q, k, v, mask, attn.scaling)
    return attn.o_proj(o.transpose(1, 2).reshape(b, s, -1)), k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The prefix's text attention of q (B, heads, S, hd) over k/v (B, kv_heads, S, hd) -> (B, heads, S, hd).
    mask None (prefix_attention=causal): causal, no mask, GQA left to the kernel. The same values for every valid
    token: prompts are right-padded (the image tokens, then the text, then its padding), so under the causal order a
    valid token's keys are all valid; only padded tokens' outputs differ, and their K/V are masked downstream (the
    loop's key mask). Otherwise the causal + padding mask, with K/V repeated to the query heads, as transformers'
    SDPA path does with a mask (the fused masked kernels take no GQA); the cache keeps the kv heads either way."""
    rep = q.shape[1] // k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=rep > 1)
    ka, va = (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))
    return F.scaled_dot_product_attention(q, ka, va, attn_mask=mask, scale=scale)


def _text_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3-VL text RMSNorm as a function: float32 statistics, the normed values rounded to x's
    dtype before the weight multiplies them."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _text_in(h, ln_w, qkv_w, qkv_b, q_norm_w, k_norm_w, cos, sin, heads: int, kv_heads: int, head_dim: int,
             eps: float, fold: bool):
    """A text layer up to attention (input norm, [q; k; v] GEMM, q/k norms, rotary: _text_attention's arithmetic)
    -> q, k, v in the layouts attention reads: (B, heads, S, hd), or with fold (B, kv_heads, heads // kv_heads * S,
    hd), normed and rotated in that layout (model._folded_queries' order), so compiled, the kernel that norms q
    writes it there; k (B, kv_heads, S, hd); v a view of the GEMM's output. A pure function of its tensors: one
    torch.compile serves every layer."""
    b, s, _ = h.shape
    q, k, v = F.linear(_text_norm(h, ln_w, eps), qkv_w, qkv_b).split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    k = _rope(_text_norm(k.view(b, s, kv_heads, head_dim), k_norm_w, eps).transpose(1, 2), cos, sin)
    v = v.view(b, s, kv_heads, head_dim).transpose(1, 2)
    if fold:
        q = q.view(b, s, kv_heads, heads // kv_heads, head_dim).permute(0, 2, 3, 1, 4)
        return _rope(_text_norm(q, q_norm_w, eps), cos, sin).reshape(b, kv_heads, -1, head_dim), k, v
    return _rope(_text_norm(q.view(b, s, heads, head_dim), q_norm_w, eps).transpose(1, 2), cos, sin), k, v


def _text_out(h, o, o_w, o_b, post_w, gate_up, down, head_dim: int, eps: float):
    """A text layer after attention: o (B, heads, S, hd), or folded (B, kv_heads, group * S, hd), through the output
    projection, the residual add, the post-attention norm and the SwiGLU MLP with its residual add -> h."""
    b, s, _ = h.shape
    h = h + F.linear(o.reshape(b, -1, s, head_dim).transpose(1, 2).reshape(b, s, -1), o_w, o_b)
    return h + _text_mlp(_text_norm(h, post_w, eps), gate_up, down)


_COMPILED: dict[str, object] = {}


def _compiled_text(name: str):
    """torch.compile'd _text_in / _text_out / _text_mlp, built on first use and shared by every layer and engine."""
    fn = _COMPILED.get(name)
    if fn is None:
        fn = _COMPILED[name] = torch.compile({"in": _text_in, "out": _text_out, "mlp": _text_mlp}[name],
                                             fullgraph=name != "mlp")
    return fn


def _text_mlp(x, gate_up: torch.Tensor, down: torch.Tensor):
    """transformers' Qwen3-VL text MLP (down(silu(gate(x)) * up(x)), no biases) with gate and up as one GEMM; a
    pure function of its tensors, so one torch.compile serves every layer."""
    g, u = F.linear(x, gate_up).split(down.shape[1], dim=-1)
    return F.linear(F.silu(g) * u, down)
