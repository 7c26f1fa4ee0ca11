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

import mlx.core as mx
import numpy as np

from ...encoders.qwen3.tokenizer import PromptTemplate, QwenPromptTokenizer, pad_token
from ...encoders.qwen3.vl import Qwen3VLEncoder, hidden_state_taps, text_quantized
from ...precision import Quantization
from ...spec import model_index
from .spec import CHAT_TEXT, MAX_SEQUENCE_LENGTH, OUT_LAYERS, PAD_MULTIPLE, SPEC

TEMPLATE = PromptTemplate(
    system_message="", text=CHAT_TEXT, empty_prompt=SPEC.conditioning["empty_prompt"]
)
PAD_POSITION = 1  # where the pipeline puts every pad token


class Flux3PromptEncoder:
    def __init__(
        self,
        encoder: Qwen3VLEncoder,
        tokenizer: QwenPromptTokenizer,
        pad_id: int,
        out_layers: tuple[int, ...],
        weight_bytes: int,
        dtype: mx.Dtype = mx.float32,
    ):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        config = encoder.language_model.config
        self.taps = hidden_state_taps(out_layers, config.num_layers, "text_encoder_out_layers")
        self.hidden_size = len(self.taps) * config.hidden_size  # the wire's D
        self.weight_bytes = weight_bytes
        self.dtype = dtype

    @classmethod
    def load(
        cls,
        model_dir: Path,
        dtype: mx.Dtype = mx.float32,
        quantization: Quantization | None = None,
        gguf: tuple[Path, Path] | None = None,
    ) -> Flux3PromptEncoder:
        """The encoder of a folder, its weights from text_encoder/ or from `gguf`, llama.cpp's
        pair of files; the tapped layers from model_index.json's `text_encoder_out_layers`
        (default: the pipeline's)."""
        model_dir = Path(model_dir)
        encoder, weight_bytes = Qwen3VLEncoder.load(
            model_dir / "text_encoder", dtype, quantization, text_quantized, gguf, text_only=True
        )
        tokenizer = QwenPromptTokenizer.load(model_dir / "tokenizer", TEMPLATE)
        pad_id = tokenizer.token_id(pad_token(model_dir / "tokenizer"))
        layers = model_index(model_dir).get("text_encoder_out_layers") or OUT_LAYERS
        return cls(encoder, tokenizer, pad_id, tuple(layers), weight_bytes, dtype)

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
        tapped = self.encoder.hidden_states(
            ids, [], [], self.taps, positions=np.stack([positions] * 3), valid_keys=real
        )
        stacked = mx.stack(tapped, axis=1).astype(mx.float32)  # (L, layers, D)
        return np.asarray(stacked).reshape(1, stacked.shape[0], -1)
