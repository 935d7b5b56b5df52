"""wam-ref's size and cost: parameter counts per tower and forward FLOPs per observation (bench and docs numbers;
works on a meta-device model, no weights needed)."""

from __future__ import annotations

from wamkit.policies.wam_ref.model import WamRefModel, head_dim_of


def num_parameters(model: WamRefModel) -> dict[str, int]:
    und, gen = model.und, model.gen
    count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    return {"total": count(model), "und": count(und), "und_vision": count(und.visual),
            "und_text": count(und.language_model), "und_text_embed": und.language_model.embed_tokens.weight.numel(),
            "gen": count(gen), "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def flops_per_observation(model: WamRefModel, text_config, *, cameras: int, image_size: int, patch_size: int,
                          gen_tokens: int, steps: int, prefix_len: int) -> dict:
    """Forward FLOPs per observation (2 per multiply-add; matmuls + attention scores), one prefix pass of
    `prefix_len` tokens plus `steps` generation-tower passes over the `gen_tokens` action (+state) tokens."""
    s = prefix_len
    tc = text_config
    L, nh = tc.num_hidden_layers, tc.num_attention_heads
    hd = head_dim_of(tc)
    und = model.und
    layer_params = sum(p.numel() for p in und.language_model.layers.parameters())
    vis_params = sum(p.numel() for n, p in und.visual.named_parameters() if "pos_embed" not in n)
    patches = cameras * (image_size // patch_size) ** 2
    vis = 2 * vis_params * patches + 4 * patches * (patches // cameras) * und.visual.config.hidden_size \
        * und.visual.config.depth
    und_f = 2 * layer_params * s + 2 * s * s * nh * hd * L  # causal: half of 4*s^2*nh*hd
    n = gen_tokens
    gen_params = sum(p.numel() for p in model.gen.blocks.parameters())
    gen_step = 2 * gen_params * n + 4 * n * (s + n) * nh * hd * L
    total = vis + und_f + steps * gen_step
    return {"vision": float(vis), "und_prefix": float(und_f), "gen_per_step": float(gen_step),
            "steps": steps, "prefix_len": s, "total": float(total)}
