"""The embedded MOSS-Image: a tiny MOSS-Image with random weights, generated on first use.

The server offers it beside the embedded default so the MOSS-Image template runs on a fresh
install: a complete folder in upstream's diffusers custom pipeline layout (model_index.json,
transformer/, vae/, text_encoder/, tokenizer/) with the real file formats, config keys and
weight names, at a small size, its weights drawn from a fixed seed (engine/embedded.py's rule).
It makes noise-like pictures, and its name says so ("moss-image-random-tiny").

Interface sizes are the real model's where clients see them: FLUX.2's VAE latents (32 channels
at stride 8, patchified 2x2 into 128 at stride 16 under its batch norm), a decoder narrower than
its encoder as MOSS-Image's, Qwen's token ids' order. The networks inside are narrow: a DiT of
two 16-wide heads and 24 blocks (so the pipeline's negative skip of block 22 applies), and a
Qwen3.5 of four layers (three Gated DeltaNet, one gated attention) at the tiny Qwen3's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...embedded import (
    BPE_VOCAB_SIZE,
    CONSTANT_NOISE,
    DIFFUSERS_FORMAT,
    FLUX2_VAE_UNDRAWN,
    GAIN,
    MATRIX,
    SEED,
    SHIFT,
    TINY_FLUX2_VAE_CONFIG,
    TINY_TEXT_WIDTH,
    TOKENIZER_CORPUS,
    Drawn,
    Inventory,
    Recipe,
    TinyTextEncoder,
    flux2_vae_tensors,
)
from .layout import DiTConfig, tensor_shapes
from .spec import MODEL_INDEX, TRANSFORMER_CLASS

MODEL_NAME = "moss-image-random-tiny"

# Qwen3.5's language model at the tiny Qwen3's width: three Gated DeltaNet layers and one
# gated attention (the real model's one in four), a quarter of each head rotated.
TINY_QWEN35_TEXT = {
    "model_type": "qwen3_5_text",
    "dtype": "float32",
    "hidden_size": TINY_TEXT_WIDTH,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
    "tie_word_embeddings": False,
}
TRANSFORMER_CONFIG = {
    "_class_name": TRANSFORMER_CLASS,
    "_diffusers_version": DIFFUSERS_FORMAT,
    "dim": 32,
    "ffn_dim": 64,
    "num_heads": 2,
    "num_layers": 24,
    "text_dim": TINY_QWEN35_TEXT["hidden_size"],
    "freq_dim": 256,
    "latent_channels": 128,
    "rope_base": 10000.0,
}
# FLUX.2's VAE with a decoder narrower than its encoder, as MOSS-Image's.
VAE_CONFIG = {**TINY_FLUX2_VAE_CONFIG, "decoder_block_out_channels": [8, 16, 16, 16]}


def transformer_tensors(config: dict) -> Inventory:
    """MOSSImageTransformer's parameters for the config, from the DiT's own table: matrices,
    norm scales around one, biases around zero."""
    shapes = tensor_shapes(DiTConfig.from_dict(config))
    return {
        name: (shape, MATRIX if len(shape) > 1 else SHIFT if name.endswith(".bias") else GAIN)
        for name, shape in shapes.items()
    }


def qwen35_text_config(vocab_size: int, text: dict = TINY_QWEN35_TEXT) -> dict:
    """The tiny Qwen3.5 checkpoint's config.json (Qwen3_5ForConditionalGeneration's layout: the
    language model's settings under `text_config`)."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text, "vocab_size": vocab_size},
        "tie_word_embeddings": False,
    }


def qwen35_tensors(text: dict, prefix: str = "model.language_model.") -> Inventory:
    """Names, shapes and kinds of Qwen3.5's language model for `text` (its text_config): the
    zero-centred norms (x (1 + w)) drawn around zero, the gated norm's scales around one."""
    hidden, inner = text["hidden_size"], text["intermediate_size"]
    heads, kv, head = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    key_heads, value_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    key_dim, value_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = 2 * key_heads * key_dim + value_heads * value_dim
    interval = text["full_attention_interval"]
    tensors: Inventory = {
        prefix + "embed_tokens.weight": ((text["vocab_size"], hidden), MATRIX),
        prefix + "norm.weight": ((hidden,), SHIFT),
    }
    for layer in range(text["num_hidden_layers"]):
        p = f"{prefix}layers.{layer}."
        linears = {
            "mlp.gate_proj": (inner, hidden),
            "mlp.up_proj": (inner, hidden),
            "mlp.down_proj": (hidden, inner),
        }
        norms = {"input_layernorm": hidden, "post_attention_layernorm": hidden}
        if (layer + 1) % interval == 0:
            linears |= {
                "self_attn.q_proj": (2 * heads * head, hidden),  # the queries and their gate
                "self_attn.k_proj": (kv * head, hidden),
                "self_attn.v_proj": (kv * head, hidden),
                "self_attn.o_proj": (hidden, heads * head),
            }
            norms |= {"self_attn.q_norm": head, "self_attn.k_norm": head}
        else:
            linears |= {
                "linear_attn.in_proj_qkv": (conv, hidden),
                "linear_attn.in_proj_z": (value_heads * value_dim, hidden),
                "linear_attn.in_proj_b": (value_heads, hidden),
                "linear_attn.in_proj_a": (value_heads, hidden),
                "linear_attn.out_proj": (hidden, value_heads * value_dim),
            }
            tensors[p + "linear_attn.conv1d.weight"] = (
                (conv, 1, text["linear_conv_kernel_dim"]),
                MATRIX,
            )
            tensors[p + "linear_attn.norm.weight"] = ((value_dim,), GAIN)
            tensors[p + "linear_attn.A_log"] = ((value_heads,), SHIFT)
            tensors[p + "linear_attn.dt_bias"] = ((value_heads,), GAIN)
        for name, shape in linears.items():
            tensors[p + name + ".weight"] = (shape, MATRIX)
        for name, width in norms.items():
            tensors[p + name + ".weight"] = ((width,), SHIFT)
    return tensors


@dataclass(frozen=True)
class TinyQwen35(TinyTextEncoder):
    """A tiny Qwen3.5 of `text` (its text_config) under the checkpoint's names (no vision
    tower, no language-model head)."""

    text: dict

    @property
    def recipe(self) -> dict:
        return {"text": self.text, "tokens": [BPE_VOCAB_SIZE, TOKENIZER_CORPUS]}

    def config_of(self, tokenizer) -> dict:
        return qwen35_text_config(tokenizer.get_vocab_size(), self.text)

    def tensors_of(self, config: dict) -> Inventory:
        return qwen35_tensors(config["text_config"])


def recipe(
    transformer: dict = TRANSFORMER_CONFIG, text: dict = TINY_QWEN35_TEXT, vae: dict = VAE_CONFIG
) -> Recipe:
    """What decides a tiny MOSS-Image folder's files (engine/embedded.py: its stamp's
    fingerprint): the embedded model's at the defaults; the tests draw other shapes with
    their own `transformer`, `text` and `vae` configs."""
    parts = (
        Drawn("transformer", transformer, transformer_tensors(transformer)),
        Drawn("vae", vae, flux2_vae_tensors(vae), FLUX2_VAE_UNDRAWN),
        TinyQwen35(text),
    )
    documents = {"model_index": MODEL_INDEX}
    return Recipe(MODEL_NAME, CONSTANT_NOISE, parts, documents)


RECIPE = recipe()
ensure_embedded_model = RECIPE.ensure


def write_embedded_model(root: Path, seed: int = SEED, **shapes) -> None:
    """Write every file of a tiny MOSS-Image folder into `root` (created if missing), of the
    `recipe` of `shapes`."""
    recipe(**shapes).write_folder(root, seed)
