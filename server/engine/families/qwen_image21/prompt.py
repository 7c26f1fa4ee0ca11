"""Qwen-Image 2.1's prompt encoder: Qwen3-VL (encoders/qwen3) under the pipeline's template.

Only what diffusers' `QwenImage21Pipeline.encode_prompt` uses: the result is the last decoder
layer's output *before* the final RMSNorm (the pipeline neutralises that norm; the DiT was trained
on the un-normalised states). The system-message rows are dropped; the image-pad rows are cut out
into `image_slots`. Weights load from `text_encoder/` by transformers' names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...base import EngineInputError
from ...encoders.prompt import PromptEncoder
from ...encoders.qwen3.processor import VisionPreprocessor
from ...encoders.qwen3.tokenizer import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    PromptTemplate,
    QwenPromptTokenizer,
)
from ...encoders.qwen3.vl import Qwen3VLEncoder, Qwen3VLPart
from ...weights import read_config
from .images import ReferenceImage, prepare_reference
from .spec import SPEC

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
# The chat template's rendering of a system message (ChatML), which is also the template's prefix.
SYSTEM_MESSAGE = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
TEMPLATE = PromptTemplate(
    system_message=SYSTEM_MESSAGE,
    text=SYSTEM_MESSAGE + "<|im_start|>user\n{images}{prompt}<|im_end|>\n<|im_start|>assistant\n",
    image_placeholder="<image{index}>" + VISION_START + IMAGE_PAD + VISION_END,
    empty_prompt=SPEC.conditioning.empty_prompt,
)
TAPPED_LAYERS = (-1,)  # the conditioning: the last decoder layer, before the final norm


def quantized(path: str) -> bool:
    """The text encoder's layers a quantized load quantizes, by module path: the linear layers
    of the decoder's layers and of the vision blocks, and the token table (151,936 rows at the
    full model's width: 1.24 GB in bf16, 0.35 GB at 4 bits). The patch embedder, the position
    table and the vision mergers keep float32."""
    return path == "language_model.embed_tokens" or path.startswith(
        ("language_model.layers.", "visual.blocks.")
    )


@dataclass
class PromptEncoding:
    cond: np.ndarray  # (1, L, D) float32, text rows only
    image_slots: list[int]  # per image, the text row before which its pad rows stood
    vae_images: list[np.ndarray]  # each (H, W, 4) float32 in [0, 1]
    token_ids: np.ndarray | None = None  # (L_all,) the ids after the dropped system prefix


# The most tokens a prompt may hold: the reference DiT's RoPE table holds 8192 frame positions
# (diffusers' QwenImage21 rotary embedding), and the pipeline cuts no prompt, so a longer one is
# refused before the text encoder, whose attention grows with the square of its length, runs.
MAX_PROMPT_TOKENS = 8192


class QwenImage21PromptEncoder(PromptEncoder):
    """Qwen3-VL whole (a GGUF pair is llama.cpp's language model and its `mmproj`), under the
    pipeline's template, with the vision preprocessor of processor/ for reference images."""

    PART = Qwen3VLPart(quantized)

    def __init__(
        self,
        encoder: Qwen3VLEncoder,
        tokenizer: QwenPromptTokenizer,
        preprocessor: VisionPreprocessor,
        weight_bytes: int,
        dtype: mx.Dtype = mx.float32,
    ):
        width = encoder.language_model.config.hidden_size
        super().__init__(encoder, tokenizer, weight_bytes, width, dtype)
        self.preprocessor = preprocessor

    @classmethod
    def from_folder(cls, model_dir: Path, dtype: mx.Dtype, quantization, gguf):
        encoder, weight_bytes = Qwen3VLEncoder.load(
            model_dir / "text_encoder", dtype, quantization, quantized, gguf
        )
        tokenizer = QwenPromptTokenizer.load(model_dir / "processor", TEMPLATE)
        config = read_config(model_dir / "text_encoder")
        if tokenizer.image_pad_id != config.get("image_token_id", tokenizer.image_pad_id):
            raise ValueError("the tokenizer's <|image_pad|> id differs from the text encoder's")
        preprocessor = VisionPreprocessor.load(model_dir / "processor")
        return cls(encoder, tokenizer, preprocessor, weight_bytes, dtype)

    def prepare_images(self, images: list[np.ndarray]) -> list[ReferenceImage]:
        return [prepare_reference(image, self.preprocessor) for image in images]

    def encode(self, text: str, images: list[np.ndarray]) -> PromptEncoding:
        references = self.prepare_images(images)
        return self.encode_prepared(text, references)

    def encode_prepared(self, text: str, references: list[ReferenceImage]) -> PromptEncoding:
        prompt = self.tokenizer.encode(text, [ref.slot_count for ref in references])
        if prompt.ids.shape[0] > MAX_PROMPT_TOKENS:
            raise EngineInputError(
                f"the prompt is {prompt.ids.shape[0]} tokens (with its template and image"
                f" slots); {SPEC.title} reads at most {MAX_PROMPT_TOKENS}"
            )
        (hidden,) = self.encoder.hidden_states(
            prompt.ids, prompt.image_spans, references, TAPPED_LAYERS
        )
        keep = self.tokenizer.drop_index
        is_image = np.zeros(prompt.ids.shape[0], dtype=bool)
        for start, end in prompt.image_spans:
            is_image[start:end] = True
        text_rows = np.flatnonzero(~is_image[keep:]) + keep
        # Text rows (after the dropped prefix) that precede each image's first pad row.
        slots = [int(np.count_nonzero(~is_image[keep:start])) for start, _ in prompt.image_spans]
        cond = hidden[mx.array(text_rows)].astype(mx.float32)
        return PromptEncoding(
            cond=np.asarray(cond)[None],
            image_slots=slots,
            vae_images=[ref.vae_image for ref in references],
            token_ids=prompt.ids[keep:],
        )
