"""Krea 2's prompt encoder: Qwen3-VL (encoders/qwen3) under the pipeline's layout.

`Krea2Pipeline.get_text_hidden_states` tokenizes the template's system prefix with the prompt,
pads that to a fixed length, appends the assistant suffix after the padding and masks the
padding; positions count the real tokens only. The padding is thus never attended and moves no
position, so the real tokens' hidden states are those of the same tokens without it: here the
prefix, the prompt (cut where the pipeline cuts it) and the suffix run unpadded. The hidden
states after the tapped layers are stacked per token and the prefix rows dropped; the row's
conditioning is (1, L, num_text_layers x hidden), each token's layers one after another (the
wire's (1, L, D) form). Weights load from `text_encoder/` by transformers' names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ...encoders.qwen3.tokenizer import read_tokenizer
from ...encoders.qwen3.vl import TappedTextPrompt
from .spec import MAX_SEQUENCE_LENGTH, PREFIX, PREFIX_ROWS, SELECT_LAYERS, SUFFIX, SUFFIX_TOKENS


class Krea2PromptEncoder(TappedTextPrompt):
    TAPS_SETTING = "text_encoder_select_layers"
    TAPS = SELECT_LAYERS

    @staticmethod
    def read_tokenizer(folder: Path) -> Tokenizer:
        return read_tokenizer(folder / "tokenizer.json")

    def token_ids(self, text: str) -> np.ndarray:
        """The pipeline's real tokens: prefix and prompt cut to its length, then the suffix."""
        kept = MAX_SEQUENCE_LENGTH + PREFIX_ROWS - SUFFIX_TOKENS
        head = self.tokenizer.encode(PREFIX + text, add_special_tokens=False).ids[:kept]
        tail = self.tokenizer.encode(SUFFIX, add_special_tokens=False).ids
        return np.asarray(head + tail, dtype=np.int32)

    def encode(self, text: str) -> np.ndarray:
        """(1, L, num_text_layers * hidden) float32: the tapped states of the tokens after the
        prefix rows, each token's layers in tap order."""
        return self.stacked(self.token_ids(text), first_row=PREFIX_ROWS)
