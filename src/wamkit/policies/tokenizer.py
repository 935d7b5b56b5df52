"""Byte-level tokenizer built in code (no downloads): UTF-8 bytes are ids 0..255, special tokens follow.

The special ids match the Qwen3-VL config that wam-ref builds for its random-weight sizes (`SPECIAL_IDS`), so
`vocab_size = ByteTokenizer.VOCAB_SIZE`. A user with real Qwen3-VL weights (`und_path=`) gets the tokenizer files of
that directory instead when they are there (`load_tokenizer`), loaded locally.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<vision_start>", "<vision_end>", "<image_pad>", "<video_pad>", "<state>")
SPECIAL_IDS = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}


class ByteTokenizer:
    """UTF-8 bytes -> ids; fixed-length encoding with an attention mask (right padding)."""

    VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

    def __init__(self, vision_start_id: int | None = None, vision_end_id: int | None = None,
                 image_id: int | None = None, video_id: int | None = None, pad_id: int | None = None):
        self.pad_id = SPECIAL_IDS["<pad>"] if pad_id is None else int(pad_id)
        self.bos_id = SPECIAL_IDS["<bos>"]
        self.eos_id = SPECIAL_IDS["<eos>"]
        self.vision_start_id = SPECIAL_IDS["<vision_start>"] if vision_start_id is None else int(vision_start_id)
        self.vision_end_id = SPECIAL_IDS["<vision_end>"] if vision_end_id is None else int(vision_end_id)
        self.image_id = SPECIAL_IDS["<image_pad>"] if image_id is None else int(image_id)
        self.video_id = SPECIAL_IDS["<video_pad>"] if video_id is None else int(video_id)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_fixed(self, texts: Sequence[str], length: int) -> tuple[np.ndarray, np.ndarray]:
        """(N, length) int64 ids and (N, length) bool mask; text truncated to `length` tokens, right-padded."""
        ids = np.full((len(texts), length), self.pad_id, np.int64)
        mask = np.zeros((len(texts), length), bool)
        for i, t in enumerate(texts):
            toks = self.encode(t)[:length]
            ids[i, :len(toks)] = toks
            mask[i, :len(toks)] = True
        return ids, mask


class HFTokenizerAdapter(ByteTokenizer):
    """A local Hugging Face tokenizer (from a weights directory) behind the same small interface."""

    def __init__(self, tok, vision_start_id: int, vision_end_id: int, image_id: int, video_id: int):
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        super().__init__(vision_start_id, vision_end_id, image_id, video_id, pad_id=pad)
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))


def load_tokenizer(und_path: str | None, config) -> ByteTokenizer:
    """The tokenizer of a local weights directory if it has one, else the byte-level tokenizer.

    config: the Qwen3VLConfig (its special token ids are used either way)."""
    ids = dict(vision_start_id=config.vision_start_token_id, vision_end_id=config.vision_end_token_id,
               image_id=config.image_token_id, video_id=config.video_token_id)
    if und_path is not None and any((Path(und_path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return HFTokenizerAdapter(AutoTokenizer.from_pretrained(str(und_path), local_files_only=True), **ids)
    return ByteTokenizer(**ids)
