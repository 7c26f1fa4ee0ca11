"""A small Qwen-style tokenizer trained on a corpus, for the embedded random-weight models (and
the tests' tiny folders): Qwen's normalizer, pre-tokenizer split and byte-level decoder, a BPE
learnt from a few sentences, then Qwen's added tokens in Qwen's order. Its `tokenizer.json`
loads wherever Qwen's does (the server's `QwenTokenizer`, transformers' `AutoTokenizer`)."""

from __future__ import annotations

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
