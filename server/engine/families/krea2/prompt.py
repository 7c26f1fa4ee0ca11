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

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from ...encoders.qwen3.vl import Qwen3VLEncoder, hidden_state_taps, text_quantized
from ...precision import Quantization
from ...spec import model_index
from .spec import MAX_SEQUENCE_LENGTH, PREFIX, PREFIX_ROWS, SELECT_LAYERS, SUFFIX, SUFFIX_TOKENS


class Krea2PromptEncoder:
    def __init__(
        self,
        encoder: Qwen3VLEncoder,
        tokenizer: Tokenizer,
        select_layers: tuple[int, ...],
        weight_bytes: int,
        dtype: mx.Dtype = mx.float32,
    ):
        self.encoder = encoder
        self.tokenizer = tokenizer
        config = encoder.language_model.config
        self.taps = hidden_state_taps(
            tuple(select_layers), config.num_layers, "text_encoder_select_layers"
        )
        self.text_dim = config.hidden_size
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
    ) -> Krea2PromptEncoder:
        """The encoder of a folder, its weights from text_encoder/ or from `gguf`, llama.cpp's
        pair of files; the tapped layers from model_index.json (the pipeline's defaults)."""
        model_dir = Path(model_dir)
        encoder, weight_bytes = Qwen3VLEncoder.load(
            model_dir / "text_encoder", dtype, quantization, text_quantized, gguf, text_only=True
        )
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer" / "tokenizer.json"))
        select = model_index(model_dir).get("text_encoder_select_layers") or SELECT_LAYERS
        return cls(encoder, tokenizer, tuple(select), weight_bytes, dtype)

    def token_ids(self, text: str) -> np.ndarray:
        """The pipeline's real tokens: prefix and prompt cut to its length, then the suffix."""
        kept = MAX_SEQUENCE_LENGTH + PREFIX_ROWS - SUFFIX_TOKENS
        head = self.tokenizer.encode(PREFIX + text, add_special_tokens=False).ids[:kept]
        tail = self.tokenizer.encode(SUFFIX, add_special_tokens=False).ids
        return np.asarray(head + tail, dtype=np.int32)

    def encode(self, text: str) -> np.ndarray:
        """(1, L, num_text_layers * hidden) float32: the tapped states of the tokens after the
        prefix rows, each token's layers in tap order."""
        ids = self.token_ids(text)
        tapped = self.encoder.hidden_states(ids, [], [], self.taps)
        stacked = mx.stack(tapped, axis=1)[PREFIX_ROWS:].astype(mx.float32)  # (L, layers, D)
        return np.asarray(stacked).reshape(1, stacked.shape[0], -1)
