"""FLUX.2 klein's prompt encoder: Qwen3 (encoders/qwen3) under the pipeline's chat template.

What diffusers' `Flux2KleinPipeline._get_qwen3_prompt_embeds` does: the prompt as one user turn
of Qwen3's chat template with the generation prompt and thinking switched off (the empty
thinking block follows `<|im_start|>assistant\\n`), tokenized, cut to MAX_SEQUENCE_LENGTH
tokens and right-padded to that length with the tokenizer's pad token under an attention mask;
the hidden states after the decoder layers the pipeline taps (`hidden_states[9]`, `[18]`,
`[27]`: the outputs of layers 8, 17 and 26), concatenated along the features per token, the
padding's rows included (the DiT attends to all of them). An empty prompt stays empty. The
decoder layers after the last tapped one are never read, so they never load.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ...encoders.qwen3.text import Qwen3Part, Qwen3Prompt
from ...encoders.qwen3.tokenizer import PromptTemplate, pad_token
from .spec import LOADED_LAYERS, TAPPED_LAYERS
from .spec import SPEC_4B as SPEC

# Qwen3's chat template rendering [{"role": "user", "content": prompt}] with
# add_generation_prompt=True and enable_thinking=False.
TEMPLATE = PromptTemplate(
    system_message="",
    text="<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    empty_prompt=SPEC.conditioning.empty_prompt,
)
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default, padded to and cut at


class Flux2PromptEncoder(Qwen3Prompt):
    """Qwen3's first LOADED_LAYERS decoder layers under the pipeline's chat template (as
    Z-Image's, its quantized layers Qwen3's choice), padded with the tokenizer's pad token."""

    TEMPLATE = TEMPLATE
    # its first LOADED_LAYERS decoder layers load (a quantized folder keeps them all)
    PART = Qwen3Part(LOADED_LAYERS)

    def __init__(self, encoder, tokenizer, pad_id: int, dtype: mx.Dtype = mx.float32):
        super().__init__(encoder, tokenizer, dtype)
        self.pad_id = pad_id
        self.hidden_size = len(TAPPED_LAYERS) * encoder.hidden_size  # the tapped layers'

    @classmethod
    def of(cls, model_dir: Path, encoder, tokenizer, dtype: mx.Dtype) -> Flux2PromptEncoder:
        pad_id = tokenizer.token_id(pad_token(Path(model_dir) / "tokenizer"))
        return cls(encoder, tokenizer, pad_id, dtype)

    def token_ids(self, text: str) -> tuple[np.ndarray, int]:
        """The padded ids (MAX_SEQUENCE_LENGTH,) and how many of them are the prompt's."""
        ids = self.tokenizer.encode(text, []).ids[:MAX_SEQUENCE_LENGTH]
        padding = np.full(MAX_SEQUENCE_LENGTH - len(ids), self.pad_id, np.int32)
        return np.concatenate([ids, padding]).astype(np.int32), len(ids)

    def encode(self, text: str) -> np.ndarray:
        """The conditioning (1, MAX_SEQUENCE_LENGTH, 3 * hidden) float32 of a prompt."""
        ids, length = self.token_ids(text)
        tapped = self.encoder.hidden_states(ids, TAPPED_LAYERS, valid_keys=length)
        joined = mx.concatenate(tapped, axis=-1).astype(mx.float32)
        return np.asarray(joined)[None]
