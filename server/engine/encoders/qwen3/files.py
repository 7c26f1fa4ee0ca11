"""Qwen3's transformers config told from one weight file's header (a text encoder without its
folder: ComfyUI's `qwen_3_4b.safetensors`, transformers' names under `model.`; or a llama.cpp
GGUF file, `token_embd.weight`, `blk.N.attn_q.weight`). The sizes come from the shapes; what
shapes cannot tell (the RoPE base, the norm epsilon) is Qwen3's, the same at every size. Also
Qwen3-VL's language model, its `text_config` (`vl_text_config`: transformers' names under
`model.language_model.` or `language_model.`, or llama.cpp's `qwen3vl` GGUF). No MLX: the
listing of model files reads it."""

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


def embedding_said(header: Header) -> str:
    """The file's token embedding as a refusal says it: its shape, or that it has none."""
    embed = shape(header, "embed")
    if embed is None:
        return f"it has no embedding ({NAMES['embed'][0]})"
    return f"its embedding ({NAMES['embed'][0]}) is {list(embed)}"


def is_qwen3(header: Header) -> bool:
    """Whether the file holds a Qwen3 decoder (its q/k norms tell it from Qwen2.5; a GGUF file
    of Qwen3-VL's language model, under the same names, is not one)."""
    if header.architecture == VL_ARCHITECTURE:
        return False
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


# -- Qwen3-VL's language model -----------------------------------------------------------------

VL_ARCHITECTURE = "qwen3vl"  # llama.cpp's
VL_PREFIXES = ("model.language_model.", "language_model.")
VL_ROPE_THETA = 5_000_000.0  # Qwen3-VL's RoPE base (its configs' rope_parameters)
# Where Qwen3-VL's tokenizer is published (tokenizer.json at the repository's root), for a
# family whose text encoder comes as one file (engine/components.py's TOKENIZER_REPO).
VL_TOKENIZER_REPO = "Qwen/Qwen3-VL-4B-Instruct"
VL_TOKENIZER_INCLUDE = "tokenizer.json"
LLAMA_NAMES = {key: names[-1] for key, names in NAMES.items()}


def vl_names(header: Header) -> dict[str, str] | None:
    """The file's names of Qwen3-VL's language-model tensors (NAMES' keys), None when it holds
    no Qwen3-VL language model."""
    if header.architecture == VL_ARCHITECTURE:
        return LLAMA_NAMES if all(n in header.shapes for n in LLAMA_NAMES.values()) else None
    for prefix in VL_PREFIXES:
        names = {key: prefix + names[1] for key, names in NAMES.items()}
        if all(name in header.shapes for name in names.values()):
            return names
    return None


def vl_width(header: Header) -> int | None:
    """The language model's hidden width (None: not a Qwen3-VL file)."""
    names = vl_names(header)
    return None if names is None else header.shapes[names["embed"]][1]


def tapped_text_config(encoder: Header, width: int, layers: int, taps, reader: str) -> dict:
    """Qwen3-VL's `text_config` for a file serving a DiT that reads `layers` of its hidden
    states side by side, `width` wide in all, the pipeline tapping `taps` (entries of
    `hidden_states`); `reader`, what of the DiT reads them, for the error. A ComponentError
    when the file is of another width or has too few layers."""
    from ...components import ComponentError

    found = vl_width(encoder)
    if found is None or found * layers != width:
        raise ComponentError(
            f"{encoder.path} is not a Qwen3-VL text encoder {width // layers} wide, as {reader}"
            " takes" + ("" if found is None else f"; its language model is {found} wide")
        )
    text = vl_text_config(encoder)
    if text["num_hidden_layers"] < max(taps):
        raise ComponentError(
            f"{encoder.path} has {text['num_hidden_layers']} layers; the pipeline taps the"
            f" states after layer {max(taps)}"
        )
    return text


def vl_layers(header: Header) -> int:
    return header.count(*(prefix + "layers." for prefix in VL_PREFIXES), "blk.")


def vl_text_config(header: Header) -> dict:
    """Qwen3-VL's `text_config` for the file (its RoPE base from a GGUF file's metadata, else
    Qwen3-VL's; its multimodal RoPE sections in Qwen3-VL's proportions, which text alone,
    every axis at one position, does not depend on); a HeaderError when it is none."""
    names = vl_names(header)
    if names is None:
        raise HeaderError(
            f"{header.path} is not a Qwen3-VL text encoder: it has no {VL_PREFIXES[0]}"
            f"{NAMES['q_norm'][1]} (nor llama.cpp's {LLAMA_NAMES['q_norm']})"
        )
    vocab, hidden = header.shapes[names["embed"]]
    head_dim = header.shapes[names["q_norm"]][0]
    half = head_dim // 2
    spatial = half * 5 // 16
    theta = header.metadata.get(f"{VL_ARCHITECTURE}.rope.freq_base", VL_ROPE_THETA)
    return {
        "model_type": "qwen3_vl_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": header.shapes[names["gate"]][0],
        "num_hidden_layers": vl_layers(header),
        "num_attention_heads": header.shapes[names["q"]][0] // head_dim,
        "num_key_value_heads": header.shapes[names["k"]][0] // head_dim,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_NORM_EPS,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(theta),
            "mrope_section": [half - 2 * spatial, spatial, spatial],
            "mrope_interleaved": True,
        },
    }
