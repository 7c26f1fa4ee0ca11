"""The embedded Krea 2: a tiny Krea 2 turbo with random weights, generated on first use.

The server offers it beside the embedded default so that Krea 2 runs on a fresh install: a
complete folder in diffusers' `Krea2Pipeline` layout (model_index.json, transformer/, vae/,
text_encoder/, tokenizer/, scheduler/) with the real file formats, config keys and weight names,
at a small size, its weights drawn from a fixed seed (engine/embedded.py's rule). It makes
noise-like pictures, and its name says so ("krea2-random-tiny").

Interface sizes are the real model's where clients see them: the VAE's 16 channels at stride 8
under Qwen-Image's published normalisation, patchified 2x2 by the DiT; three tapped layers of
the text encoder stacked per token; Qwen's token ids' order. The networks inside are narrow and
shallow (a DiT of four 16-wide query heads over two key/value heads with two blocks, a VAE whose
widest stage has 16 channels, a Qwen3-VL of width 32). The weight names come from the DiT's own
table (layout.tensor_shapes) and the shared parts' inventories (engine/embedded.py).
"""

from __future__ import annotations

from ...embedded import (
    CONSTANT_NOISE,
    DIFFUSERS_FORMAT,
    SHIFT,
    TINY_QWEN3_VL_TAPS,
    TINY_TEXT_WIDTH,
    Drawn,
    Recipe,
    TinyQwen3VL,
    qwen_image_vae_tensors,
    table_inventory,
)
from ...vaes.from_files import QWEN_IMAGE_LATENTS
from .layout import DiTConfig, tensor_shapes
from .spec import SCHEDULER_CONFIG, model_index_of

MODEL_NAME = "krea2-random-tiny"

TRANSFORMER_CONFIG = {
    "_class_name": "Krea2Transformer2DModel",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "in_channels": 64,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "timestep_embed_dim": 32,
    "text_hidden_dim": TINY_TEXT_WIDTH,
    "num_text_layers": len(TINY_QWEN3_VL_TAPS),
    "text_num_attention_heads": 4,
    "text_num_key_value_heads": 2,
    "text_intermediate_size": 64,
    "num_layerwise_text_blocks": 1,
    "num_refiner_text_blocks": 1,
    "axes_dims_rope": [4, 6, 6],
    "rope_theta": 1000.0,
    "norm_eps": 1e-5,
}

VAE_CONFIG = {
    "_class_name": "AutoencoderKLQwenImage",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],  # four stages: stride 8
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "input_channels": 3,
    **QWEN_IMAGE_LATENTS,
}

MODEL_INDEX = model_index_of("turbo", TINY_QWEN3_VL_TAPS)


# Krea2Transformer2DModel's parameters from the DiT's own table: its matrices, modulation
# tables and projector, and its biases and norm scales (zero-centred: a norm scales by
# 1 + weight), drawn as shifts.
SHAPES = tensor_shapes(DiTConfig.from_dict(TRANSFORMER_CONFIG))
TRANSFORMER = Drawn("transformer", TRANSFORMER_CONFIG, table_inventory(SHAPES, SHIFT))
# What decides the folder's files (engine/embedded.py: its stamp's fingerprint).
PARTS = (TRANSFORMER, Drawn("vae", VAE_CONFIG, qwen_image_vae_tensors(VAE_CONFIG)), TinyQwen3VL())
DOCUMENTS = {"scheduler": SCHEDULER_CONFIG, "model_index": MODEL_INDEX}
RECIPE = Recipe(MODEL_NAME, CONSTANT_NOISE, PARTS, DOCUMENTS)
ensure_embedded_model = RECIPE.ensure
write_embedded_model = RECIPE.write_folder
