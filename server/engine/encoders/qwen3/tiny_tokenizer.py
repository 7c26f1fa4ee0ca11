"""A small Qwen-style tokenizer trained on a corpus, for the embedded random-weight models (and
the tests' tiny folders): Qwen's normalizer, pre-tokenizer split and byte-level decoder, a BPE
learnt from a few sentences, then Qwen's added tokens in Qwen's order. Its `tokenizer.json`
loads wherever Qwen's does (the server's `QwenTokenizer`, transformers' `AutoTokenizer`)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from .vocab_files import qwen_pipeline

# Qwen's added tokens in the order of their ids (151643 onwards in the real vocabulary); the
# last four are added but not special.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
PLAIN_ADDED_TOKENS = ["<tool_response>", "</tool_response>", "<think>", "</think>"]

# What the BPE learns its merges from, and its vocabulary bound.
TOKENIZER_CORPUS = [
    "A capybara wearing a wizard hat, reading a book by candlelight, oil painting",
    "a red fox in the snow, photograph, 35mm, golden hour light",
    "user assistant system the of and with in on a an",
    "0123456789 The quick brown fox jumps over the lazy dog.",
    "Ein Fuchs im Schnee. Un renard dans la neige. 雪の中のキツネ。",
] * 4
BPE_VOCAB_SIZE = 320
# Qwen3's chat template as far as a prompt encoder uses it: turns of string content, the
# generation prompt, and the empty thinking block written when thinking is switched off.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}\n"
)


def train_tokenizer(corpus: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with Qwen's normalizer, split and decoder, trained on `corpus`, then
    Qwen's added tokens in Qwen's order (so their ids follow the learned vocabulary)."""
    tokenizer = qwen_pipeline(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS]
    )
    return tokenizer


def token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The id of each of Qwen's added tokens in `tokenizer`."""
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS}


def write_tokenizer(folder: Path, tokenizer) -> None:
    """folder/tokenizer.json and tokenizer_config.json (with Qwen3's chat template)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
