"""Qwen's tokenizer rebuilt from its vocabulary and merges, where a model's files carry no
tokenizer.json: ComfyUI's own copy (`comfy/text_encoders/qwen25_tokenizer/`: vocab.json,
merges.txt, tokenizer_config.json with the added tokens) or a llama.cpp GGUF text encoder's
metadata (`tokenizer.ggml.tokens`, `.merges`, `.token_type`). Both are Qwen's byte-level BPE
under Qwen's normalizer and pre-tokenizer split (`qwen_pipeline`, which the tiny tokenizer
trains under too), the added tokens at their own ids; `tokenizers` only.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors as token_processors

# Qwen2's pre-tokenizer split, as Qwen's tokenizer.json carries it.
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# llama.cpp's token types (gguf.TokenType): the vocabulary's own, and the added ones.
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def qwen_pipeline(model: models.BPE) -> Tokenizer:
    """A tokenizer of `model` under Qwen's normalizer (NFC), split, byte-level pre-tokenizer,
    decoder and post-processor."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = token_processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _bpe(vocab: dict[str, int], merges: list[str]) -> models.BPE:
    pairs = [tuple(line.split(" ", 1)) for line in merges if line and not line.startswith("#")]
    return models.BPE(
        vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False, byte_fallback=False
    )


def _add(tokenizer: Tokenizer, added: list[tuple[int, str, bool]], where: str) -> Tokenizer:
    """Add the (id, text, special) tokens in id order; a ValueError when an id does not come
    out as the source gives it."""
    for token_id, text, special in sorted(added):
        token = AddedToken(text, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
        if tokenizer.token_to_id(text) != token_id:
            raise ValueError(
                f"{where}: the added token {text!r} has id {token_id}, which its vocabulary"
                f" does not leave free (it comes out as {tokenizer.token_to_id(text)})"
            )
    return tokenizer


def bpe_tokenizer(folder: Path) -> Tokenizer:
    """Qwen's tokenizer from a folder of vocab.json, merges.txt and tokenizer_config.json (its
    `added_tokens_decoder`)."""
    folder = Path(folder)
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    merges = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    added = [
        (int(token_id), entry["content"], bool(entry.get("special", False)))
        for token_id, entry in config.get("added_tokens_decoder", {}).items()
    ]
    return _add(qwen_pipeline(_bpe(vocab, merges)), added, str(folder))


def gguf_tokenizer(metadata: dict, where: str = "the GGUF file") -> Tokenizer:
    """Qwen's tokenizer from a GGUF file's tokenizer metadata (file_headers.gguf_tokenizer):
    the normal tokens as the vocabulary, the control and user-defined ones added (control ones
    special); a ValueError for a tokenizer that is not a byte-level BPE."""
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"{where}'s tokenizer is {metadata.get('tokenizer.ggml.model')!r}, not Qwen's"
            " byte-level BPE (gpt2)"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    kinds = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab = {
        text: i for i, (text, kind) in enumerate(zip(tokens, kinds, strict=True)) if kind == NORMAL
    }
    added = [
        (i, text, kind == CONTROL)
        for i, (text, kind) in enumerate(zip(tokens, kinds, strict=True))
        if kind in (CONTROL, USER_DEFINED)
    ]
    merges = metadata.get("tokenizer.ggml.merges") or []
    return _add(qwen_pipeline(_bpe(vocab, merges)), added, where)
