"""Qwen3.5's language model told from one file's header (no MLX: the listing of model files
reads it): llama.cpp's `qwen35` GGUF file, whose metadata says every size llama.cpp's converter
wrote (its Qwen3-Next class: the DeltaNet's kernel, key width, key and value heads, value width,
the attention interval, the rotated dims), so text_encoder/config.json comes from it whole. A
safetensors file of it cannot say its RoPE base or its DeltaNet's key width: only a GGUF file
makes a component set."""

from __future__ import annotations

import numpy as np

from ...file_headers import Header, HeaderError

ARCHITECTURE = "qwen35"
EMBED = "token_embd.weight"


def is_qwen35(header: Header) -> bool:
    return header.architecture == ARCHITECTURE and EMBED in header.shapes


def width(header: Header) -> int | None:
    """The language model's hidden width (None: not a Qwen3.5 GGUF file)."""
    if not is_qwen35(header):
        return None
    return int(header.metadata[f"{ARCHITECTURE}.embedding_length"])


def shortest(value) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (1e-06, not
    9.99999997e-07: what the checkpoint's config said)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def config(header: Header) -> dict:
    """text_encoder/config.json for the file (Qwen3_5ForConditionalGeneration's layout: the
    language model's settings under `text_config`); a HeaderError where it is none."""
    if not is_qwen35(header):
        raise HeaderError(
            f"{header.path} is not llama.cpp's Qwen3.5 file: its architecture is"
            f" {header.architecture!r}, not {ARCHITECTURE!r}, or it has no {EMBED}"
        )
    meta = {k.removeprefix(ARCHITECTURE + "."): v for k, v in header.metadata.items()}
    try:
        hidden = int(meta["embedding_length"])
        heads = int(meta["attention.head_count"])
        kv_heads = meta["attention.head_count_kv"]
        kv_heads = max(kv_heads) if isinstance(kv_heads, list) else int(kv_heads)
        head_dim = int(meta.get("attention.key_length", hidden // heads))
        value_heads = int(meta["ssm.time_step_rank"])
        vocab = next(size for size in header.shapes[EMBED] if size != hidden)
        text = {
            "model_type": "qwen3_5_text",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(meta["feed_forward_length"]),
            "num_hidden_layers": int(meta["block_count"])
            - int(meta.get("nextn_predict_layers", 0)),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": shortest(meta["attention.layer_norm_rms_epsilon"]),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": shortest(meta["rope.freq_base"]),
                "partial_rotary_factor": int(meta["rope.dimension_count"]) / head_dim,
            },
            "linear_conv_kernel_dim": int(meta["ssm.conv_kernel"]),
            "linear_key_head_dim": int(meta["ssm.state_size"]),
            "linear_num_key_heads": int(meta["ssm.group_count"]),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": int(meta["ssm.inner_size"]) // value_heads,
            "full_attention_interval": int(meta["full_attention_interval"]),
        }
    except (KeyError, StopIteration) as missing:
        raise HeaderError(
            f"{header.path} has no {ARCHITECTURE}.{missing.args[0]} metadata"
        ) from None
    return {"model_type": "qwen3_5", "text_config": text}
