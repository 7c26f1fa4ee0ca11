"""The Qwen tokenizer (tokenizer.json, read with `tokenizers`, no transformers) under a family's
prompt template.

A family's pipeline puts the prompt into a raw ChatML template string (not rendered through the
chat template), each image gets a placeholder holding one `<|image_pad|>`, and each pad is
expanded to one token per merged vision patch, as the Qwen3-VL processor does. The rows a
pipeline drops are the tokens of its system message as the chat template renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ...base import EngineInputError

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
DEFAULT_PAD_TOKEN = "<|endoftext|>"  # Qwen's, where tokenizer_config.json names none


def pad_token(tokenizer_dir: Path) -> str:
    """The pad token tokenizer_config.json names (its AddedToken form too), else Qwen's."""
    config = Path(tokenizer_dir) / "tokenizer_config.json"
    if config.is_file():
        token = json.loads(config.read_text(encoding="utf-8")).get("pad_token")
        if isinstance(token, dict):
            token = token.get("content")
        if token:
            return token
    return DEFAULT_PAD_TOKEN


@dataclass(frozen=True)
class PromptTemplate:
    """A family's template: `text` with `{images}` and `{prompt}` fields; `system_message` (its
    start, as the chat template renders it) is the rows the encoding drops; image i (from 1)
    becomes `image_placeholder` with `{index}` set, joined by `image_separator`; an empty prompt
    becomes `empty_prompt`, the spec's (`Conditioning.empty_prompt`, which the status publishes):
    a template names it, there is no default to drift from."""

    system_message: str
    text: str
    image_placeholder: str = ""
    image_separator: str = " "
    empty_prompt: str = field(kw_only=True)  # what an empty prompt is encoded as

    def render(self, prompt: str, image_count: int) -> str:
        """The templated prompt, one `<|image_pad|>` per image (before expansion)."""
        images = self.image_separator.join(
            self.image_placeholder.format(index=i) for i in range(1, image_count + 1)
        )
        return self.text.format(images=images, prompt=prompt or self.empty_prompt)


@dataclass(frozen=True)
class TokenizedPrompt:
    ids: np.ndarray  # (L,) int32, image pads expanded
    image_spans: list[tuple[int, int]]  # per image, [start, end) of its pad tokens in ids


def read_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json file; a FileNotFoundError naming it where it is missing, a ValueError
    naming it where `tokenizers` cannot read it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (the model's tokenizer)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - `tokenizers` raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer.json `tokenizers` reads: {exc}") from None


class QwenPromptTokenizer:
    """The processor folder's tokenizer.json under a family's `PromptTemplate`."""

    def __init__(self, tokenizer: Tokenizer, template: PromptTemplate):
        self.tokenizer = tokenizer
        self.template = template
        self.image_pad_id = self.token_id(IMAGE_PAD)
        self.drop_index = len(self._encode(template.system_message))

    @classmethod
    def load(cls, processor_dir: Path, template: PromptTemplate) -> QwenPromptTokenizer:
        return cls(read_tokenizer(Path(processor_dir) / "tokenizer.json"), template)

    def token_id(self, token: str) -> int:
        """The id of `token` (a ValueError where tokenizer.json has none)."""
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
        ids = self._encode(self.template.render(prompt, len(pad_counts)))
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
