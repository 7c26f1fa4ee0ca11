"""The embedded Z-Image: a tiny Z-Image Turbo with random weights, generated on first use.

The server offers it beside the embedded default (`qwen-image21-random-tiny`, which stays the
default) so the second family can be tried without downloading anything: a complete folder in
diffusers' `ZImagePipeline` layout (model_index.json, transformer/, vae/, text_encoder/,
tokenizer/, scheduler/) with the real file formats, config keys and weight names, at a small
size, its weights drawn from a fixed seed (engine/embedded.py's rule: the prompt visibly moves
the output). It makes noise-like pictures, and its name says so ("z-image-random-tiny").

Interface sizes are the real model's where clients see them: 16 latent channels at stride 8,
patch 2, an RGB VAE with FLUX.1's scaling and shift factors and its 1024-pixel tiles, Qwen's
token ids' order; the networks inside are narrow and shallow (a DiT of width 64 with two main
blocks, a VAE whose widest stage has 32 channels, a 3-layer Qwen3 of width 32). The tests'
tiny Z-Image folders are this recipe too (tests/families/z_image/tiny), at their own seeds.
"""

from __future__ import annotations

from pathlib import Path

from ...embedded import (
    CONSTANT_NOISE,
    DIFFUSERS_FORMAT,
    GAIN,
    SEED,
    SHIFT,
    TINY_AUTOENCODER_KL_BODY,
    TINY_QWEN3_CONFIG,
    Drawn,
    Inventory,
    Recipe,
    TinyQwen3,
    autoencoder_kl_tensors,
    table_inventory,
    write_drawn,
)
from . import spec
from .layout import PAD_TOKENS, DiTConfig, tensor_shapes

MODEL_NAME = "z-image-random-tiny"
VARIANT = "turbo"

TRANSFORMER_CONFIG = {
    "_class_name": "ZImageTransformer2DModel",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 64,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "cap_feat_dim": 32,  # = the text encoder's hidden size
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [8, 12, 12],  # sums to the head dim (64 / 2)
    "axes_lens": [256, 64, 64],
}
# FLUX.1's AutoencoderKL at the tiny body's sizes: its 16 latent channels, its latent
# normalisation and its two resnets a block.
VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    **TINY_AUTOENCODER_KL_BODY,
    "latent_channels": 16,
    "layers_per_block": 2,
    "force_upcast": True,
    "latents_mean": None,
    "latents_std": None,
    "sample_size": 1024,  # FLUX.1's: images up to 1024 pixels are not tiled
    "scaling_factor": 0.3611,  # FLUX.1's
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}

# vocab_size comes from the tokenizer (engine/embedded.py: TinyQwen3).
TEXT_CONFIG = {**TINY_QWEN3_CONFIG, "num_hidden_layers": 3}

MODEL_INDEX = {**spec.MODEL_INDEX, "_diffusers_version": DIFFUSERS_FORMAT}


def scheduler_config(variant: str) -> dict:
    """scheduler_config.json: the pipeline's flow-matching Euler at the variant's static shift."""
    return {**spec.scheduler_config(variant), "_diffusers_version": DIFFUSERS_FORMAT}


# ---- weights ------------------------------------------------------------------------------


def transformer_tensors(config: dict) -> Inventory:
    """Names, shapes and kinds of ZImageTransformer2DModel's parameters for `config`: the DiT's
    own table (layout.tensor_shapes), its biases and pad tokens drawn as SHIFT."""
    inventory = table_inventory(tensor_shapes(DiTConfig.from_dict(config)), GAIN)
    for name, (shape, _) in inventory.items():
        if name.endswith(".bias") or name in PAD_TOKENS.values():
            inventory[name] = (shape, SHIFT)
    return inventory


# ---- the folder ---------------------------------------------------------------------------

TEXT = TinyQwen3(TEXT_CONFIG)


def recipe(variant: str = VARIANT, transformer: dict | None = None) -> Recipe:
    """What decides a tiny Z-Image folder's files (engine/embedded.py: its stamp's
    fingerprint): the embedded model's at the defaults; `transformer`: overrides of its DiT
    config."""
    config = {**TRANSFORMER_CONFIG, **(transformer or {})}
    vae = Drawn("vae", VAE_CONFIG, autoencoder_kl_tensors(VAE_CONFIG))
    parts = (Drawn("transformer", config, transformer_tensors(config)), vae, TEXT)
    documents = {"scheduler": scheduler_config(variant), "model_index": MODEL_INDEX}
    extra = {"variant": variant}
    return Recipe(MODEL_NAME, CONSTANT_NOISE, parts, documents, extra)


RECIPE = recipe()
ensure_embedded_model = RECIPE.ensure


def write_embedded_model(
    root: Path, seed: int = SEED, variant: str = VARIANT, transformer: dict | None = None
) -> None:
    """Write every file of a tiny Z-Image folder into `root` (created if missing): the
    embedded model at the defaults; `transformer`: overrides of its DiT config."""
    recipe(variant, transformer).write_folder(root, seed)


def write_transformer(folder: Path, seed: int = SEED, **overrides) -> None:
    config = {**TRANSFORMER_CONFIG, **overrides}
    noise = CONSTANT_NOISE["transformer"]
    write_drawn(Path(folder), "transformer", config, transformer_tensors(config), seed, noise)


def write_vae(folder: Path, seed: int = SEED, **overrides) -> None:
    config = {**VAE_CONFIG, **overrides}
    noise = CONSTANT_NOISE["vae"]
    write_drawn(Path(folder), "vae", config, autoencoder_kl_tensors(config), seed, noise)


def write_text_encoder(root: Path, seed: int = SEED) -> None:
    """Write root/text_encoder (Qwen3ForCausalLM) and root/tokenizer."""
    TEXT.write(Path(root), seed, CONSTANT_NOISE)
