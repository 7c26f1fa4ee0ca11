"""The twin-blocks family's prompt encoder: Qwen3 (encoders/qwen3/text.py) under a chat
template, its last decoder layer's hidden states as the conditioning."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from gmlx_server.engine.encoders.qwen3.text import Qwen3TextEncoder, quantized
from gmlx_server.engine.encoders.qwen3.tokenizer import PromptTemplate, QwenPromptTokenizer
from gmlx_server.engine.precision import Quantization

from .spec import SPEC

TEMPLATE = PromptTemplate(
    system_message="",
    text="<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
    empty_prompt=SPEC.conditioning["empty_prompt"],
)
TAPPED_LAYERS = (-1,)


class TwinPromptEncoder:
    def __init__(self, encoder: Qwen3TextEncoder, tokenizer: QwenPromptTokenizer, dtype):
        self.encoder, self.tokenizer, self.dtype = encoder, tokenizer, dtype
        self.weight_bytes = encoder.weight_bytes
        self.hidden_size = encoder.hidden_size

    @classmethod
    def load(
        cls,
        model_dir: Path,
        dtype: mx.Dtype,
        quantization: Quantization | None = None,
        gguf: Path | None = None,
    ) -> TwinPromptEncoder:
        folder = Path(model_dir) / "text_encoder"
        encoder = Qwen3TextEncoder.load(folder, dtype, quantization, quantized, gguf)
        return cls(
            encoder, QwenPromptTokenizer.load(Path(model_dir) / "tokenizer", TEMPLATE), dtype
        )

    def encode(self, text: str) -> np.ndarray:
        """The conditioning (1, L, D) float32 of a prompt."""
        (hidden,) = self.encoder.hidden_states(self.tokenizer.encode(text, []).ids, TAPPED_LAYERS)
        return np.asarray(hidden.astype(mx.float32))[None]
