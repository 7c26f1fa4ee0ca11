"""FLUX.3 klein's prompt encoder: Qwen3-VL (encoders/qwen3) under the pipeline's layout.

What diffusers' `Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds` does: the prompt as one user
turn of Qwen3-VL's chat template with the generation prompt, tokenized and cut at
MAX_SEQUENCE_LENGTH tokens, right-padded with the tokenizer's pad token to a multiple of
PAD_MULTIPLE under an attention mask; positions count the real tokens and put every pad at
position 1. The hidden states after the tapped layers (`text_encoder_out_layers`, entries of
`hidden_states`) are stacked per token, the padding's rows included (the DiT reads all of them,
unmasked): the row's conditioning is (1, L, layers x hidden), each token's layers one after
another. Weights load from `text_encoder/` by transformers' names.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ...encoders.qwen3.tokenizer import PromptTemplate, QwenPromptTokenizer, pad_token
from ...encoders.qwen3.vl import TappedTextPrompt
from .spec import CHAT_TEXT, MAX_SEQUENCE_LENGTH, OUT_LAYERS, PAD_MULTIPLE, SPEC

TEMPLATE = PromptTemplate(
    system_message="", text=CHAT_TEXT, empty_prompt=SPEC.conditioning.empty_prompt
)
PAD_POSITION = 1  # where the pipeline puts every pad token


class Flux3PromptEncoder(TappedTextPrompt):
    TAPS_SETTING = "text_encoder_out_layers"
    TAPS = OUT_LAYERS

    @classmethod
    def from_folder(cls, model_dir: Path, *how) -> Flux3PromptEncoder:
        encoder = super().from_folder(model_dir, *how)
        encoder.pad_id = encoder.tokenizer.token_id(pad_token(model_dir / "tokenizer"))
        return encoder

    @staticmethod
    def read_tokenizer(folder: Path) -> QwenPromptTokenizer:
        return QwenPromptTokenizer.load(folder, TEMPLATE)

    def token_ids(self, text: str) -> tuple[np.ndarray, int]:
        """The padded ids and how many of them are the prompt's."""
        ids = self.tokenizer.encode(text, []).ids[:MAX_SEQUENCE_LENGTH]
        length = min(math.ceil(len(ids) / PAD_MULTIPLE) * PAD_MULTIPLE, MAX_SEQUENCE_LENGTH)
        padding = np.full(length - len(ids), self.pad_id, np.int32)
        return np.concatenate([ids, padding]).astype(np.int32), len(ids)

    def encode(self, text: str) -> np.ndarray:
        """(1, L, layers * hidden) float32, L the padded length."""
        ids, real = self.token_ids(text)
        positions = np.full(ids.shape[0], PAD_POSITION, np.int64)
        positions[:real] = np.arange(real)
        return self.stacked(ids, positions=np.stack([positions] * 3), valid_keys=real)
