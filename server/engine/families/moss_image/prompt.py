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
from tokenizers import Tokenizer

from ...encoders.qwen35.text import TextModel, load_text_model
from ...precision import Quantization
from .spec import CHAT_TEXT, MAX_SEQUENCE_LENGTH


class MOSSImagePromptEncoder:
    def __init__(self, model: TextModel, tokenizer: Tokenizer, weight_bytes: int, dtype: mx.Dtype):
        self.model = model
        self.tokenizer = tokenizer
        self.hidden_size = model.config.hidden_size  # the wire's D
        self.weight_bytes = weight_bytes
        self.dtype = dtype

    @classmethod
    def load(
        cls,
        model_dir: Path,
        dtype: mx.Dtype = mx.float32,
        quantization: Quantization | None = None,
        gguf: Path | None = None,
    ) -> MOSSImagePromptEncoder:
        """The encoder of a folder, its weights from text_encoder/ or from `gguf`, llama.cpp's
        `qwen35` file (with a `quantization`, the decoder layers' linears and the token table
        of float weights quantized as they load)."""
        model_dir = Path(model_dir)
        folder = model_dir / "text_encoder"
        model, weight_bytes = load_text_model(folder, dtype, quantization, gguf)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer" / "tokenizer.json"))
        return cls(model, tokenizer, weight_bytes, dtype)

    def token_ids(self, text: str) -> np.ndarray:
        """The pipeline's tokens: the templated prompt, cut at MAX_SEQUENCE_LENGTH."""
        rendered = CHAT_TEXT.format(prompt=text)
        ids = self.tokenizer.encode(rendered, add_special_tokens=False).ids
        return np.asarray(ids[:MAX_SEQUENCE_LENGTH], dtype=np.int32)

    def encode(self, text: str) -> np.ndarray:
        """(1, L, hidden) float32: the last hidden state of the templated prompt's tokens."""
        (last,) = self.model.hidden_states(self.token_ids(text), [self.model.config.num_layers])
        return np.asarray(last.astype(mx.float32))[None]
