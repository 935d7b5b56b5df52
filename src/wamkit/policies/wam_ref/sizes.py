"""wam-ref size presets: the Qwen3-VL config of the understanding tower and the generation tower's width.

The generation tower always has the understanding tower's depth and head layout (heads, kv heads, head_dim); its
hidden size and FFN width default to the understanding tower's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wamkit.core.errors import unknown_choice
from wamkit.policies.tokenizer import SPECIAL_IDS, ByteTokenizer


@dataclass(frozen=True)
class SizePreset:
    text: dict[str, Any]
    vision: dict[str, Any]
    image_size: int               # per camera, square; multiple of patch_size * spatial_merge_size
    max_text_len: int             # task text tokens (bytes), right-padded to this length
    gen_hidden: int | None = None
    gen_ffn: int | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _byte_vocab() -> dict[str, Any]:
    return dict(image_token_id=SPECIAL_IDS["<image_pad>"], video_token_id=SPECIAL_IDS["<video_pad>"],
                vision_start_token_id=SPECIAL_IDS["<vision_start>"], vision_end_token_id=SPECIAL_IDS["<vision_end>"])


SIZES: dict[str, SizePreset] = {
    "tiny": SizePreset(
        text=dict(vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4],
                                   "mrope_interleaved": True}),
        vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=8, spatial_merge_size=2,
                    temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=64,
                    deepstack_visual_indexes=[0]),
        image_size=64, max_text_len=48, notes="CPU tests; 16 image tokens per camera"),
    "small": SizePreset(
        text=dict(vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 8, 8],
                                   "mrope_interleaved": True}),
        vision=dict(depth=8, hidden_size=384, intermediate_size=1536, num_heads=6, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=768, num_position_embeddings=196,
                    deepstack_visual_indexes=[2, 5]),
        image_size=224, max_text_len=96, notes="49 image tokens per camera"),
    # SFT throughput at >= 1B parameters on one GPU: two ~1.2B towers (2.5B in all) with a byte vocabulary.
    "1b": SizePreset(
        text=dict(vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}),
        vision=dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=196,
                    deepstack_visual_indexes=[3, 7, 11]),
        image_size=224, max_text_len=96, notes="GPU SFT benchmarks: 1.2B per tower, 49 image tokens per camera"),
    # Cosmos3-Nano tower shape (Qwen3-VL-8B): build on the meta device, materialize on a GPU for cost measurements.
    "nano-shape": SizePreset(
        text=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24]),
        image_size=256, max_text_len=128, notes="Qwen3-VL-8B understanding tower + same-shape generation tower",
        extra=dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                   vision_end_token_id=151653)),
}


def size_names() -> list[str]:
    return list(SIZES)


def get_size(name: str) -> SizePreset:
    if name not in SIZES:
        raise unknown_choice("wam-ref size", name, size_names())
    return SIZES[name]


def qwen3vl_config_dict(name: str) -> dict[str, Any]:
    """The Qwen3VLConfig kwargs of a size (JSON-able)."""
    p = get_size(name)
    ids = p.extra if "image_token_id" in p.extra else _byte_vocab()
    return dict(text_config=dict(p.text), vision_config=dict(p.vision), tie_word_embeddings=False, **ids)
