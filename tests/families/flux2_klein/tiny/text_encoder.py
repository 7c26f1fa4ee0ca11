"""A tiny random Qwen3 text encoder and tokenizer folder for FLUX.2 klein tests.

`build_text_encoder(model_dir)` writes `model_dir/text_encoder` (a random `Qwen3ForCausalLM`,
32 wide and deep enough for the layers the pipeline taps, 9, 18 and 27) and
`model_dir/tokenizer` (the tiny Qwen-style tokenizer with Qwen3's chat template of the embedded
models, server/engine/encoders/qwen3/tiny_tokenizer.py). Nothing is downloaded; torch and transformers are test-only.
"""

from __future__ import annotations

from pathlib import Path

from gmlx_server.engine.encoders.qwen3.tiny_tokenizer import (
    BPE_VOCAB_SIZE,
    TOKENIZER_CORPUS,
    train_tokenizer,
    write_tokenizer,
)

from tests.families.tiny_weights import redraw

TINY_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 28,  # hidden_states[27] is the output of the 27th of them
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
LINEAR_GAIN = 1.0
CONSTANT_NOISE = 0.1


def build_text_encoder(model_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write model_dir/text_encoder and model_dir/tokenizer; returns model_dir."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir = Path(model_dir)
    tokenizer = train_tokenizer(TOKENIZER_CORPUS, BPE_VOCAB_SIZE)
    write_tokenizer(model_dir / "tokenizer", tokenizer)
    vocab_size = tokenizer.get_vocab_size()
    config = Qwen3Config(**{**TINY_TEXT, **overrides}, vocab_size=vocab_size)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    redraw(model, torch.Generator().manual_seed(seed + 1), LINEAR_GAIN, CONSTANT_NOISE)
    model.save_pretrained(model_dir / "text_encoder")
    return model_dir
