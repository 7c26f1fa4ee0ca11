"""The twin-blocks family's prompt encoder: Qwen3 (encoders/qwen3/text.py) under a chat
template, its last decoder layer's hidden states as the conditioning."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gmlx_server.engine.encoders.qwen3.text import Qwen3Prompt
from gmlx_server.engine.encoders.qwen3.tokenizer import PromptTemplate

from .spec import SPEC

TEMPLATE = PromptTemplate(
    system_message="",
    text="<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
    empty_prompt=SPEC.conditioning.empty_prompt,
)
TAPPED_LAYERS = (-1,)


class TwinPromptEncoder(Qwen3Prompt):
    TEMPLATE = TEMPLATE

    def encode(self, text: str) -> np.ndarray:
        """The conditioning (1, L, D) float32 of a prompt."""
        (hidden,) = self.encoder.hidden_states(self.tokenizer.encode(text, []).ids, TAPPED_LAYERS)
        return np.asarray(hidden.astype(mx.float32))[None]
