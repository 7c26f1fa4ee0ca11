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
    DIFFUSERS_FORMAT,
    GAIN,
    MATRIX,
    SEED,
    SHIFT,
    TINY_AUTOENCODER_KL_BODY,
    TINY_QWEN3_CONFIG,
    Drawn,
    Inventory,
    Recipe,
    TinyQwen3,
    autoencoder_kl_tensors,
    linear_tensors,
    write_drawn,
)
from . import spec

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
# diffusers' constants: the time embedder's sinusoid width and hidden width, and the widest
# modulation input.
TIME_FREQUENCIES = 256
TIME_MID_SIZE = 1024
ADALN_EMBED_DIM = 256

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

# Noise given to parameters that start constant, per component (the DiT's pad tokens and
# norms need more to matter).
CONSTANT_NOISE = {"transformer": 0.3, "vae": 0.1, "text_encoder": 0.1}

MODEL_INDEX = {**spec.MODEL_INDEX, "_diffusers_version": DIFFUSERS_FORMAT}


def scheduler_config(variant: str) -> dict:
    """scheduler_config.json: the pipeline's flow-matching Euler at the variant's static shift."""
    return {**spec.scheduler_config(variant), "_diffusers_version": DIFFUSERS_FORMAT}


# ---- weights ------------------------------------------------------------------------------


def transformer_tensors(config: dict) -> Inventory:
    """Names, shapes and kinds of ZImageTransformer2DModel's parameters for `config`."""
    dim, heads = config["dim"], config["n_heads"]
    head, hidden = dim // heads, int(dim / 3 * 8)
    kv = config.get("n_kv_heads", heads) * head
    adaln = min(dim, ADALN_EMBED_DIM)
    patch = config["all_patch_size"][0]
    key = f"{patch}-{config['all_f_patch_size'][0]}"
    patch_values = patch * patch * config["all_f_patch_size"][0] * config["in_channels"]
    tensors: Inventory = {
        "x_pad_token": ((1, dim), SHIFT),
        "cap_pad_token": ((1, dim), SHIFT),
        "cap_embedder.0.weight": ((config["cap_feat_dim"],), GAIN),
    }
    linear_tensors(tensors, f"all_x_embedder.{key}", patch_values, dim)
    linear_tensors(tensors, f"all_final_layer.{key}.linear", dim, patch_values)
    linear_tensors(tensors, f"all_final_layer.{key}.adaLN_modulation.1", adaln, dim)
    linear_tensors(tensors, "t_embedder.mlp.0", TIME_FREQUENCIES, TIME_MID_SIZE)
    linear_tensors(tensors, "t_embedder.mlp.2", TIME_MID_SIZE, adaln)
    linear_tensors(tensors, "cap_embedder.1", config["cap_feat_dim"], dim)
    stacks = {
        "noise_refiner": (config["n_refiner_layers"], True),
        "context_refiner": (config["n_refiner_layers"], False),
        "layers": (config["n_layers"], True),
    }
    for stack, (depth, modulated) in stacks.items():
        for index in range(depth):
            prefix = f"{stack}.{index}."
            for name, shape in {
                "attention.to_q": (heads * head, dim),
                "attention.to_k": (kv, dim),
                "attention.to_v": (kv, dim),
                "attention.to_out.0": (dim, heads * head),
                "feed_forward.w1": (hidden, dim),
                "feed_forward.w2": (dim, hidden),
                "feed_forward.w3": (hidden, dim),
            }.items():
                tensors[prefix + name + ".weight"] = (shape, MATRIX)
            for name in ("attention.norm_q", "attention.norm_k"):
                tensors[prefix + name + ".weight"] = ((head,), GAIN)
            for name in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
                tensors[prefix + name + ".weight"] = ((dim,), GAIN)
            if modulated:
                linear_tensors(tensors, prefix + "adaLN_modulation.0", adaln, 4 * dim)
    return tensors


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
