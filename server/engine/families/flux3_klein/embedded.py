"""The embedded FLUX.3 klein: a tiny FLUX.3 klein (distilled, a flow map) with random weights,
generated on first use.

The server offers it beside the embedded default so the FLUX.3 klein templates run on a fresh
install: a complete folder in diffusers' layout of the distilled modular pipeline
(model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/) with the real file
formats, config keys and weight names, at a small size, its weights drawn from a fixed seed
(engine/embedded.py's rule). It makes noise-like pictures, and its name says so
("flux3-klein-random-tiny").

Interface sizes are the real model's where clients see them: the VAE's 32 channels at stride 8,
patchified 2x2 into 128 at stride 16 under its batch norm; three tapped layers of the text
encoder stacked per token; Qwen's token ids' order. The networks inside are narrow and shallow
(a DiT of two 16-wide heads with one per-mode block per mode and two joint blocks, the shared
tiny FLUX.2 VAE and Qwen3-VL of engine/embedded.py). The weight names come from the DiT's own
table (layout.tensor_shapes) and the shared parts' inventories.
"""

from __future__ import annotations

from ...embedded import (
    CONSTANT_NOISE,
    DIFFUSERS_FORMAT,
    GAIN,
    TINY_FLUX2_VAE,
    TINY_QWEN3_VL_TAPS,
    TINY_TEXT_WIDTH,
    Drawn,
    Recipe,
    TinyQwen3VL,
    table_inventory,
)
from .layout import DiTConfig, tensor_shapes
from .spec import SCHEDULER_CONFIG, model_index_of

MODEL_NAME = "flux3-klein-random-tiny"

TRANSFORMER_CONFIG = {
    "_class_name": "Flux3Transformer2DModel",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "in_channels": 128,
    "cond_in_channels": 128,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": len(TINY_QWEN3_VL_TAPS) * TINY_TEXT_WIDTH,
    "timestep_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [4, 4, 4, 4],  # a quarter of the head each, as the real model's
    "rope_theta": 10000,
    "eps": 1e-06,
    "flow_map": True,
}

MODEL_INDEX = model_index_of("distilled", TINY_QWEN3_VL_TAPS)


# Flux3Transformer2DModel's parameters from the DiT's own table: its matrices and its norm
# scales (it has no biases).
SHAPES = tensor_shapes(DiTConfig.from_dict(TRANSFORMER_CONFIG))
TRANSFORMER = Drawn("transformer", TRANSFORMER_CONFIG, table_inventory(SHAPES, GAIN))
# What decides the folder's files (engine/embedded.py: its stamp's fingerprint).
PARTS = (TRANSFORMER, TINY_FLUX2_VAE, TinyQwen3VL())
DOCUMENTS = {"scheduler": SCHEDULER_CONFIG, "model_index": MODEL_INDEX}
RECIPE = Recipe(MODEL_NAME, CONSTANT_NOISE, PARTS, DOCUMENTS)
ensure_embedded_model = RECIPE.ensure
write_embedded_model = RECIPE.write_folder
