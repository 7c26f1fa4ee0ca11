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

import mlx.core as mx
import numpy as np

from ...encoders.qwen3.text import Qwen3Prompt
from ...encoders.qwen3.tokenizer import PromptTemplate
from .spec import SPEC

# Qwen3's chat template rendering [{"role": "user", "content": prompt}] with
# add_generation_prompt=True and enable_thinking=True.
TEMPLATE = PromptTemplate(
    system_message="",
    text="<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
    empty_prompt=SPEC.conditioning.empty_prompt,
)
TAPPED_LAYERS = (-2,)  # hidden_states[-2]: the second-to-last decoder layer's output
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default truncation


class ZImagePromptEncoder(Qwen3Prompt):
    """Qwen3 under the pipeline's chat template, all its layers loaded."""

    TEMPLATE = TEMPLATE

    def token_ids(self, text: str) -> np.ndarray:
        return self.tokenizer.encode(text, []).ids[:MAX_SEQUENCE_LENGTH]

    def encode(self, text: str) -> np.ndarray:
        """The conditioning (1, L, D) float32 of a prompt."""
        (hidden,) = self.encoder.hidden_states(self.token_ids(text), TAPPED_LAYERS)
        return np.asarray(hidden.astype(mx.float32))[None]
