"""What the text encoders' decoder configs share (Qwen3's, Qwen3.5's): the widths, depth and
heads of a transformers text config and its RoPE base, read one way. No MLX."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float


def decoder_settings(config: dict, rope: dict, rope_theta: float) -> dict:
    """DecoderConfig's fields from a transformers text config: as many key/value heads as
    query heads and a head of the hidden width over them where it names none; the RoPE base
    from its `rope` parameters, else its own `rope_theta`, else `rope_theta`."""
    heads = config["num_attention_heads"]
    return {
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", rope_theta))),
    }
