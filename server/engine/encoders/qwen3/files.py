"""Qwen3's transformers config told from one weight file's header (a text encoder without its
folder: ComfyUI's `qwen_3_4b.safetensors`, transformers' names under `model.`; or a llama.cpp
GGUF file, `token_embd.weight`, `blk.N.attn_q.weight`). The sizes come from the shapes; what
shapes cannot tell (the RoPE base, the norm epsilon) is Qwen3's, the same at every size. No
MLX: the listing of model files reads it."""

from __future__ import annotations

from ...file_headers import Header, HeaderError

ROPE_THETA = 1_000_000.0
RMS_NORM_EPS = 1e-6
MAX_POSITIONS = 40960
# The same tensors by transformers' name (under `model.` or not) and llama.cpp's.
NAMES = {
    "embed": ("model.embed_tokens.weight", "embed_tokens.weight", "token_embd.weight"),
    "q": (
        "model.layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.q_proj.weight",
        "blk.0.attn_q.weight",
    ),
    "k": (
        "model.layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "blk.0.attn_k.weight",
    ),
    "q_norm": (
        "model.layers.0.self_attn.q_norm.weight",
        "layers.0.self_attn.q_norm.weight",
        "blk.0.attn_q_norm.weight",
    ),
    "gate": (
        "model.layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "blk.0.ffn_gate.weight",
    ),
}
LAYER_STEMS = ("model.layers.", "layers.", "blk.")


def shape(header: Header, key: str) -> tuple[int, ...] | None:
    return header.first_shape(NAMES[key])


def is_qwen3(header: Header) -> bool:
    """Whether the file holds a Qwen3 decoder (its q/k norms tell it from Qwen2.5)."""
    return all(shape(header, key) is not None for key in NAMES)


def width(header: Header) -> int | None:
    """The decoder's hidden width (None: not a Qwen3 file)."""
    embed = shape(header, "embed")
    return embed[1] if embed is not None and is_qwen3(header) else None


def layers(header: Header) -> int:
    return header.count(*LAYER_STEMS)


def config(header: Header) -> dict:
    """text_encoder/config.json for the file; a HeaderError naming the first tensor missing."""
    for key, names in NAMES.items():
        if shape(header, key) is None:
            raise HeaderError(f"{header.path} is not a Qwen3 text encoder: it has no {names[0]}")
    vocab, hidden = shape(header, "embed")
    head_dim = shape(header, "q_norm")[0]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": shape(header, "gate")[0],
        "num_hidden_layers": layers(header),
        "num_attention_heads": shape(header, "q")[0] // head_dim,
        "num_key_value_heads": shape(header, "k")[0] // head_dim,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": MAX_POSITIONS,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
