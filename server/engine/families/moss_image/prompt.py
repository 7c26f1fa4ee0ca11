"""MOSS-Image's prompt encoder: Qwen3.5's language model (encoders/qwen35) under the
pipeline's layout.

The pipeline renders the prompt as one user turn of Qwen3.5's chat template with the generation
prompt and thinking on (`CHAT_TEXT`), tokenizes it cut at MAX_SEQUENCE_LENGTH tokens, and takes
the language model's last hidden state (after the final norm), one prompt at a time and
unpadded. The row's conditioning is those states, (1, L, hidden). Weights load from
`text_encoder/` by transformers' names, or from llama.cpp's GGUF file (text_encoder/config.json
still describes it); the tokenizer from `tokenizer/tokenizer.json`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ...encoders.prompt import PromptEncoder
from ...encoders.qwen3.tokenizer import read_tokenizer
from ...encoders.qwen35.text import Qwen35Part, load_text_model
from .spec import CHAT_TEXT, MAX_SEQUENCE_LENGTH


class MOSSImagePromptEncoder(PromptEncoder):
    """Qwen3.5's language model (`encoder`, a qwen35.text.TextModel); a GGUF file is llama.cpp's
    `qwen35` one, and a quantized load quantizes the decoder layers' linears and the token
    table of float weights."""

    PART = Qwen35Part()

    @classmethod
    def from_folder(cls, model_dir: Path, dtype: mx.Dtype, quantization, gguf):
        model, weight_bytes = load_text_model(model_dir / "text_encoder", dtype, quantization, gguf)
        tokenizer = read_tokenizer(model_dir / "tokenizer" / "tokenizer.json")
        return cls(model, tokenizer, weight_bytes, model.config.hidden_size, dtype)

    def token_ids(self, text: str) -> np.ndarray:
        """The pipeline's tokens: the templated prompt, cut at MAX_SEQUENCE_LENGTH."""
        rendered = CHAT_TEXT.format(prompt=text)
        ids = self.tokenizer.encode(rendered, add_special_tokens=False).ids
        return np.asarray(ids[:MAX_SEQUENCE_LENGTH], dtype=np.int32)

    def encode(self, text: str) -> np.ndarray:
        """(1, L, hidden) float32: the last hidden state of the templated prompt's tokens."""
        model = self.encoder
        (last,) = model.hidden_states(self.token_ids(text), [model.config.num_layers])
        return np.asarray(last.astype(mx.float32))[None]
