"""The embedded FLUX.2 klein: a tiny FLUX.2 klein 4B (distilled) with random weights, generated
on first use.

The server offers it beside the embedded default so the FLUX.2 klein templates run on a fresh
install: a complete folder in diffusers' `Flux2KleinPipeline` layout (model_index.json,
transformer/, vae/, text_encoder/, tokenizer/, scheduler/) with the real file formats, config
keys and weight names, at a small size, its weights drawn from a fixed seed (engine/embedded.py's
rule). It makes noise-like pictures, and its name says so ("flux2-klein-random-tiny").

Interface sizes are the real model's where clients see them: the VAE's 32 channels at stride 8,
patchified 2x2 into 128 at stride 16 under its batch norm, the three tapped Qwen3 layers side
by side (so 28 decoder layers, 27 of them read), Qwen's token ids' order; the networks inside
are narrow and shallow (a DiT of two 32-wide heads with two double- and two single-stream
blocks, a VAE whose widest stage has 32 channels, a Qwen3 of width 32). The weight names come
from the DiT's own tables (layout.py) and the shared parts' inventories (engine/embedded.py).
"""

from __future__ import annotations

from ...embedded import (
    CONSTANT_NOISE,
    DIFFUSERS_FORMAT,
    GAIN,
    TINY_FLUX2_VAE,
    TINY_QWEN3_CONFIG,
    TINY_TEXT_WIDTH,
    Drawn,
    Recipe,
    TinyQwen3,
    table_inventory,
)
from .layout import DiTConfig, tensor_shapes
from .spec import FAMILY_4B, SCHEDULER, TAPPED_LAYERS, model_index_of

MODEL_NAME = "flux2-klein-random-tiny"

TRANSFORMER_CONFIG = {
    "_class_name": "Flux2Transformer2DModel",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": len(TAPPED_LAYERS) * TINY_TEXT_WIDTH,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [8, 8, 8, 8],  # a quarter of the head each, as the real model's
    "rope_theta": 2000,
    "eps": 1e-06,
    "guidance_embeds": False,
}

TEXT_CONFIG = {**TINY_QWEN3_CONFIG, "num_hidden_layers": max(TAPPED_LAYERS) + 2}  # one unread

MODEL_INDEX = {**model_index_of(FAMILY_4B, "distilled"), "_diffusers_version": DIFFUSERS_FORMAT}


# Flux2Transformer2DModel's parameters from the DiT's own tables: its matrices and its norm
# scales (it has no biases).
SHAPES = tensor_shapes(DiTConfig.from_dict(TRANSFORMER_CONFIG))
TRANSFORMER = Drawn("transformer", TRANSFORMER_CONFIG, table_inventory(SHAPES, GAIN))
# What decides the folder's files (engine/embedded.py: its stamp's fingerprint).
PARTS = (TRANSFORMER, TINY_FLUX2_VAE, TinyQwen3(TEXT_CONFIG))
DOCUMENTS = {
    "scheduler": {**SCHEDULER, "_diffusers_version": DIFFUSERS_FORMAT},
    "model_index": MODEL_INDEX,
}
RECIPE = Recipe(MODEL_NAME, CONSTANT_NOISE, PARTS, DOCUMENTS)
ensure_embedded_model = RECIPE.ensure
write_embedded_model = RECIPE.write_folder
