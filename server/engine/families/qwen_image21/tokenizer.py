"""Qwen-Image 2.1 prompt tokenization: the pipeline's templates over the Qwen tokenizer.json.

Mirrors diffusers' `QwenImage21Pipeline._get_qwen_prompt_embeds`: the prompt is put into a raw
ChatML template string (not rendered through the chat template), each reference image gets a
`<imageN><|vision_start|><|image_pad|><|vision_end|>` placeholder, and each `<|image_pad|>` is
expanded to one token per merged vision patch, as the Qwen3-VL processor does. The rows the
pipeline drops are the tokens of the system message as the chat template renders it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ...base import EngineInputError

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"

# The chat template's rendering of a system message (ChatML), which is also the template's prefix.
SYSTEM_MESSAGE = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
TEXT_TEMPLATE = (
    SYSTEM_MESSAGE + "<|im_start|>user\n{images}{prompt}<|im_end|>\n<|im_start|>assistant\n"
)


def image_placeholders(count: int) -> str:
    """The pipeline's vision placeholders: `<image1>...`, then ` <image2>...` and so on."""
    parts = [f"<image{i}>{VISION_START}{IMAGE_PAD}{VISION_END}" for i in range(1, count + 1)]
    return " ".join(parts)


def prompt_text(prompt: str, image_count: int) -> str:
    """The templated prompt, one `<|image_pad|>` per image (before expansion)."""
    # Qwen has no BOS token, so an empty prompt would leave the encoder nothing to read.
    prompt = prompt or " "
    return TEXT_TEMPLATE.format(images=image_placeholders(image_count), prompt=prompt)


@dataclass(frozen=True)
class TokenizedPrompt:
    ids: np.ndarray  # (L,) int32, image pads expanded
    image_spans: list[tuple[int, int]]  # per image, [start, end) of its pad tokens in ids


class QwenPromptTokenizer:
    """The processor folder's tokenizer.json read with `tokenizers` (no transformers)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.image_pad_id = self._special_id(IMAGE_PAD)
        self.drop_index = len(self._encode(SYSTEM_MESSAGE))

    @classmethod
    def load(cls, processor_dir: Path) -> QwenPromptTokenizer:
        return cls(Tokenizer.from_file(str(Path(processor_dir) / "tokenizer.json")))

    def _special_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer.json has no {token} token")
        return token_id

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, prompt: str, pad_counts: list[int]) -> TokenizedPrompt:
        """Token ids of the templated prompt with image i's pad expanded to pad_counts[i] tokens."""
        if IMAGE_PAD in prompt or VIDEO_PAD in prompt:
            # The processor would count these as placeholders and misplace the image rows.
            raise EngineInputError(f"the prompt may not contain {IMAGE_PAD} or {VIDEO_PAD}")
        # Special tokens are split out before BPE, so expanding the pad id after tokenizing
        # gives the ids the processor gets from tokenizing the expanded string.
        ids = self._encode(prompt_text(prompt, len(pad_counts)))
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        counts = iter(pad_counts)
        for token_id in ids:
            if token_id == self.image_pad_id:
                count = next(counts)
                spans.append((len(out), len(out) + count))
                out.extend([token_id] * count)
            else:
                out.append(token_id)
        return TokenizedPrompt(np.asarray(out, dtype=np.int32), spans)
