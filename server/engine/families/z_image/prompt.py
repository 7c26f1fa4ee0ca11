"""Z-Image's prompt encoder: Qwen3 (encoders/qwen3) under the pipeline's chat template.

What diffusers' `ZImagePipeline._encode_prompt` does: the prompt as one user turn of Qwen3's
chat template with the generation prompt and thinking enabled (which adds nothing after
`<|im_start|>assistant\\n`), tokenized and cut to MAX_SEQUENCE_LENGTH tokens, and
`hidden_states[-2]` of the text encoder, that is the output of the second-to-last decoder layer
(before any final norm), with the padding rows dropped. An empty prompt stays empty (the
template's own tokens remain). Weights load from `text_encoder/` by transformers' names, the
tokenizer from `tokenizer/tokenizer.json`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ...encoders.qwen3.text import Qwen3TextEncoder, quantized
from ...encoders.qwen3.tokenizer import PromptTemplate, QwenPromptTokenizer
from ...precision import Quantization
from .spec import SPEC

# Qwen3's chat template rendering [{"role": "user", "content": prompt}] with
# add_generation_prompt=True and enable_thinking=True.
TEMPLATE = PromptTemplate(
    system_message="",
    text="<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
    empty_prompt=SPEC.conditioning["empty_prompt"],
)
TAPPED_LAYERS = (-2,)  # hidden_states[-2]: the second-to-last decoder layer's output
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default truncation


class ZImagePromptEncoder:
    def __init__(self, encoder: Qwen3TextEncoder, tokenizer: QwenPromptTokenizer, dtype: mx.Dtype):
        """`dtype`: the dtype it computes in, the one it loaded at (its weights may be held
        quantized, a GGUF file's token table too)."""
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.weight_bytes = encoder.weight_bytes
        self.hidden_size = encoder.hidden_size
        self.dtype = dtype

    @classmethod
    def load(
        cls,
        model_dir: Path,
        dtype: mx.Dtype = mx.float32,
        quantization: Quantization | None = None,
        gguf: Path | None = None,
    ) -> ZImagePromptEncoder:
        """The encoder of a folder, its weights from text_encoder/ or from `gguf`, a llama.cpp
        GGUF file of Qwen3 (text_encoder/config.json still describes it); with a
        `quantization`, its decoder layers' float linears (`quantized`) are quantized as they
        load (Qwen3's choice, encoders.qwen3.text.quantized)."""
        model_dir = Path(model_dir)
        encoder = Qwen3TextEncoder.load(
            model_dir / "text_encoder", dtype, quantization, quantized, gguf
        )
        tokenizer = QwenPromptTokenizer.load(model_dir / "tokenizer", TEMPLATE)
        return cls(encoder, tokenizer, dtype)

    def token_ids(self, text: str) -> np.ndarray:
        return self.tokenizer.encode(text, []).ids[:MAX_SEQUENCE_LENGTH]

    def encode(self, text: str) -> np.ndarray:
        """The conditioning (1, L, D) float32 of a prompt."""
        (hidden,) = self.encoder.hidden_states(self.token_ids(text), TAPPED_LAYERS)
        return np.asarray(hidden.astype(mx.float32))[None]
