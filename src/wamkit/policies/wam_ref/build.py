"""Building wam-ref's network: the understanding tower's config (a size preset, a Qwen3VLConfig dict, or local
Qwen3-VL weights), both towers, and their deterministic initialization.

Random-weight models bound for an accelerator or for sharding are built on the meta device (no memory) and
initialized afterwards on their device (`init_weights`); a CPU build initializes at once. Both give the same
weights for the same `init_seed` on the same device type (tests/test_policy_wam_ref.py pins it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from wamkit.core.errors import UserError
from wamkit.policies.wam_ref.config import WamRefConfig
from wamkit.policies.wam_ref.model import (GenerationTower, WamRefModel, init_weights,
                                          use_batched_vision_attention)
from wamkit.policies.wam_ref.sizes import get_size, qwen3vl_config_dict


@dataclass
class Towers:
    """The understanding tower's config (and module, when loaded from local weights) before the model is built."""

    config: object                 # transformers Qwen3VLConfig
    und: torch.nn.Module | None    # Qwen3VLModel with loaded weights (und_path), else None (built randomly)


def understanding_tower(cfg: WamRefConfig) -> Towers:
    """The Qwen3-VL config of `cfg` (preset, und_config or und_path); loads the weights of und_path (locally)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if cfg.und_path is not None:
        if not Path(cfg.und_path).is_dir():
            raise UserError(f"und_path {cfg.und_path!r} is not a local directory (nothing is downloaded)")
        full = Qwen3VLForConditionalGeneration.from_pretrained(str(cfg.und_path), dtype=cfg.torch_dtype,
                                                               local_files_only=True)
        und = full.model
        del full
        return Towers(und.config, und)
    qcfg = Qwen3VLConfig(**(cfg.und_config if cfg.und_config is not None else qwen3vl_config_dict(cfg.size)))
    qcfg._attn_implementation = "sdpa"
    return Towers(qcfg, None)


def generation_width(cfg: WamRefConfig, text_config) -> tuple[int, int]:
    """(hidden, ffn) of the generation tower: the config's, else the preset's, else the understanding tower's."""
    preset = get_size(cfg.size)
    return (int(cfg.gen_hidden_size or preset.gen_hidden or text_config.hidden_size),
            int(cfg.gen_intermediate_size or preset.gen_ffn or text_config.intermediate_size))


def build_model(cfg: WamRefConfig, towers: Towers, model_action_dim: int, device: torch.device) -> WamRefModel:
    """Both towers, in eval mode. On the CPU (or with loaded understanding weights): built and initialized there,
    then moved to `device` in cfg's dtype. Otherwise (an accelerator, or device "meta"): built on the meta device
    and left there; the caller initializes it on its device (`init_on`)."""
    from transformers import Qwen3VLModel

    tc = towers.config.text_config
    hidden, ffn = generation_width(cfg, tc)
    on_meta = cfg.und_path is None and device.type != "cpu"
    und = towers.und
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        with torch.device("meta" if on_meta else "cpu"):
            if und is None:
                und = Qwen3VLModel(towers.config)
            gen = GenerationTower(tc, hidden, ffn, model_action_dim, cfg.state_dim)
            model = WamRefModel(und, gen)
        if not on_meta:
            torch.manual_seed(cfg.init_seed)  # same weights as a meta build + init_on()
            init_weights(model if cfg.und_path is None else model.gen)
    if not on_meta:
        model.to(device=device, dtype=cfg.torch_dtype)
    model.eval()
    return model


def init_on(model: WamRefModel, device: torch.device, init_seed: int, round_to: torch.dtype | None = None) -> None:
    """A meta-built model (plain or sharded by FSDP2) -> real tensors on `device`, deterministically initialized
    from init_seed (`to_empty` + init_weights; rotary buffers recomputed). Leaves torch's global RNG as it was."""
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(init_seed)
        init_weights(model, round_to=round_to)


def batch_vision_attention(model: WamRefModel) -> bool:
    """All images have one size here: the vision tower's attention runs as one call over all images instead of
    transformers' one call per image (same arithmetic; see model.vision_attention_equal_length). False (with a
    warning) when this transformers has no hook for it: its per-image calls stay."""
    try:
        use_batched_vision_attention(model.und)
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(f"wam-ref: batched vision attention unavailable ({e}); using transformers' own")
        return False
    return True
