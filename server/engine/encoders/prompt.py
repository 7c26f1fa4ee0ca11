"""What every family's prompt encoder is, whatever its network: the network and the tokenizer,
the bytes its loaded weights hold, the width of the conditioning it gives (the wire's D) and the
dtype it computes in. FolderFamily loads one through `load`, the one signature they share, and
reads its text encoder's files through the class's `PART`; a family's class says how it reads
its folder (`from_folder`) and how it encodes a prompt."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..precision import Quantization


class PromptEncoder(ABC):
    # Its text encoder as FolderFamily reads the files (`gguf`, `source`, `include`,
    # `module_name`, `quantized`: encoders/qwen3/text.py's Qwen3Part, encoders/qwen3/vl.py's
    # Qwen3VLPart, encoders/qwen35/text.py's Qwen35Part).
    PART: Any

    def __init__(self, encoder: Any, tokenizer: Any, weight_bytes: int, hidden_size: int, dtype):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.weight_bytes = weight_bytes
        self.hidden_size = hidden_size  # the wire's D
        self.dtype = dtype  # the dtype it computes in, the one it loaded at

    @property
    def network(self):
        """The loaded network whose layers a quantized load quantized (its status reads them)."""
        return self.encoder

    @classmethod
    def load(
        cls,
        model_dir: Path,
        dtype: mx.Dtype = mx.float32,
        quantization: Quantization | None = None,
        gguf: Any = None,
    ):
        """The encoder of a folder: its weights from text_encoder/ by transformers' names, or
        from `gguf`, the llama.cpp file(s) of the family's text encoder (the part's `gguf`),
        kept quantized as they hold them; with a `quantization`, the layers the family's
        encoder picks are quantized as they load (a folder stored quantized loads as stored)."""
        return cls.from_folder(Path(model_dir), dtype, quantization, gguf)

    @classmethod
    @abstractmethod
    def from_folder(cls, model_dir: Path, dtype: mx.Dtype, quantization, gguf):
        """`load`'s work, its arguments as given."""
