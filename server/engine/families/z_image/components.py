"""Z-Image from its component files (engine/components.py): the DiT as ComfyUI's
`diffusion_models` hold it (Lumina2's NextDiT names, optionally under `model.diffusion_model.`;
GGUF files converted from it) or in diffusers' names, Qwen3 as one file (ComfyUI's
`qwen_3_4b.safetensors` or llama.cpp's GGUF) and FLUX.1's `ae.safetensors`. No MLX.

ComfyUI tells Z-Image by `cap_embedder.1.weight` with `noise_refiner.0.attention.k_norm.weight`
(Lumina 2's NextDiT) and a `cap_pad_token` (without it the file is another NextDiT); here the
same, in either naming. Turbo and base have the same shapes: the file's name says which
(`turbo`, `base`), else the model entry must (`variant`).
"""

from __future__ import annotations

from ...encoders.qwen3 import files as qwen3_files
from ...file_headers import Header
from ...vaes import from_files as vae_files
from . import layout
from .spec import FAMILY, MODEL_INDEX, scheduler_config

TOKENIZER_REPO = "Tongyi-MAI/Z-Image-Turbo"
PATCH = 2
# Z-Image's one patch size (layout.DiTConfig's), which diffusers' names carry as a patch key.
PATCHED = layout.DiTConfig(patch_size=PATCH)


def top(key: str) -> tuple[str, str]:
    """A weight outside the blocks by ComfyUI's name and diffusers' (layout.py's tables)."""
    diffusers = layout.top_name(layout.TOP_LINEARS[key], PATCHED)
    return layout.COMFY_TOP[key] + ".weight", diffusers + ".weight"


def first_block(stack: str, key: str) -> tuple[str, str]:
    """A weight of a stack's first block by ComfyUI's name and diffusers'."""
    first = layout.STACKS[stack][0].format(0)
    (diffusers,) = layout.block_parts(key)
    return first + layout.COMFY_BLOCK[key] + ".weight", first + diffusers + ".weight"


X_EMBEDDER = top("x_in")
CAPTION = layout.TOP_LINEARS["cap_in"] + ".weight"  # the same name in both
Q_NORM = first_block("layers", "norm_q")
K_NORM = first_block("noise_refiner", "norm_k")
PAD_TOKEN = layout.PAD_TOKENS["cap_pad"]
# Z-Image's RoPE axes split the head as 32:48:48 of 128, and its fixed constants (diffusers'
# ZImageTransformer2DModel config, ComfyUI's Z-Image detection).
AXES_SHARES = (1 / 4, 3 / 8, 3 / 8)
DIT_FACTS = {
    "_class_name": "ZImageTransformer2DModel",
    "all_patch_size": [PATCH],
    "all_f_patch_size": [1],
    "axes_lens": [1536, 512, 512],
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}
# FLUX.1's autoencoder: its group count and latent normalisation (ae.safetensors' config).
VAE_FACTS = {
    "_class_name": "AutoencoderKL",
    "norm_num_groups": 32,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "sample_size": 1024,
    "force_upcast": True,
    "latents_mean": None,
    "latents_std": None,
}


def stem(stack: str) -> str:
    """The name stem of a block stack's tensors (`layers.` of `layers.{}.`)."""
    return layout.STACKS[stack][0].partition("{}")[0]


def family(dit: Header) -> str | None:
    if dit.has(CAPTION, PAD_TOKEN) and dit.first_shape(K_NORM) and dit.first_shape(X_EMBEDDER):
        return FAMILY
    return None


def fits_encoder(dit: Header, encoder: Header) -> bool:
    return qwen3_files.width(encoder) == dit.shape(CAPTION)[1]


def fits_vae(dit: Header, vae: Header) -> bool:
    return vae_files.latent_channels(vae) == 16 and not vae_files.has_batch_norm(vae)


def dit_config(dit: Header) -> dict:
    dim, patch_channels = dit.first_shape(X_EMBEDDER)
    head_dim = dit.first_shape(Q_NORM)[0]
    return {
        **DIT_FACTS,
        "in_channels": patch_channels // (PATCH * PATCH),
        "dim": dim,
        "n_layers": dit.count(stem("layers")),
        "n_refiner_layers": dit.count(stem("noise_refiner")),
        "n_heads": dim // head_dim,
        "n_kv_heads": dim // head_dim,
        "cap_feat_dim": dit.shape(CAPTION)[1],
        "axes_dims": [round(head_dim * share) for share in AXES_SHARES],
    }


def configs(family: str, variant: str, dit: Header, encoder: Header, vae: Header) -> dict:
    from ...components import ComponentError

    transformer = dit_config(dit)
    if qwen3_files.width(encoder) != transformer["cap_feat_dim"]:
        raise ComponentError(
            f"{encoder.path} is not a Qwen3 text encoder {transformer['cap_feat_dim']} wide, as"
            f" the DiT {dit.path.name} takes ({CAPTION}); {qwen3_files.embedding_said(encoder)}"
        )
    channels = vae_files.latent_channels(vae)
    if channels != transformer["in_channels"] or vae_files.has_batch_norm(vae):
        raise ComponentError(
            f"{vae.path} is not FLUX.1's {transformer['in_channels']}-channel autoencoder that"
            f" Z-Image decodes with ({vae_files.channels_said(channels)}"
            + (", and it has FLUX.2's batch norm)" if vae_files.has_batch_norm(vae) else ")")
        )
    return {
        "model_index.json": MODEL_INDEX,
        "transformer/config.json": transformer,
        "text_encoder/config.json": qwen3_files.config(encoder),
        "vae/config.json": vae_files.config(vae, VAE_FACTS),
        "scheduler/scheduler_config.json": scheduler_config(variant),
    }
