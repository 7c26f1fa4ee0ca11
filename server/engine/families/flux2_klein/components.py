"""FLUX.2 klein from its component files (engine/components.py): the DiT as BFL publishes it and
ComfyUI's `diffusion_models` hold it (`double_blocks.N.img_attn.qkv.weight`, ..., optionally
under `model.diffusion_model.`; GGUF files converted from it) or in diffusers' names, Qwen3 as
one file (ComfyUI's `qwen_3_4b.safetensors`, `qwen_3_8b...`, or llama.cpp's GGUF) and FLUX.2's
VAE (`flux2-vae.safetensors`: ldm names and the batch norm). No MLX.

ComfyUI tells FLUX.2 by `double_stream_modulation_img.lin.weight`; a guidance embedder
(`guidance_in`) is FLUX.2 dev, not klein. The 9B DiT has 8 double-stream blocks (the 4B 5);
the KV model has the 9B's shapes, so only the entry can say it (`family`). Distilled and base
have the same shapes: BFL names the base files `...-base-...`, the distilled ones without.
"""

from __future__ import annotations

from ...config_keys import flux_width_settings
from ...encoders.qwen3 import files as qwen3_files
from ...file_headers import Header
from ...vaes import from_files as vae_files
from . import layout
from .spec import (
    FAMILY_4B,
    FAMILY_9B,
    LOADED_LAYERS,
    NINE_B_DOUBLE_BLOCKS,
    SCHEDULER,
    TAPPED_LAYERS,
    model_index_of,
)


def top(key: str) -> tuple[str, str]:
    """A weight outside the blocks by BFL's name and diffusers' (layout.py's tables)."""
    return layout.BFL_TOP[key] + ".weight", layout.TOP_LINEARS[key] + ".weight"


def first_double(key: str) -> tuple[str, str]:
    """A weight of the first double block by BFL's name and diffusers' (layout.py's tables: a
    linear layer made of one diffusers layer, or a norm scale, `.scale` in BFL's files)."""
    if key in layout.DOUBLE_NORMS:
        name, bfl = layout.DOUBLE_NORMS[key]
        bfl += ".scale"
    else:
        (name,), bfl = layout.DOUBLE_LINEARS[key]
        bfl += ".weight"
    return layout.BFL_DOUBLE_BLOCK.format(0) + bfl, layout.DOUBLE.format(0) + name + ".weight"


def stems(*blocks: str) -> tuple[str, ...]:
    """The name stems of a block stack's tensors (`double_blocks.` of `double_blocks.{}.`)."""
    return tuple(block.partition("{}")[0] for block in blocks)


MODULATION = top("mod_img")
IMAGE_IN = top("x_in")
TEXT_IN = top("ctx_in")
QUERY_NORM = first_double("norm_q")
MLP_IN = first_double("img_ff_in")
DOUBLE_STEMS = stems(layout.BFL_DOUBLE_BLOCK, layout.DOUBLE)
SINGLE_STEMS = stems(layout.BFL_SINGLE_BLOCK, layout.SINGLE)
# A guidance embedder (FLUX.2 dev's, which klein has not), by BFL's name and diffusers'.
GUIDANCE = ("guidance_in.in_layer.weight", "time_guidance_embed.guidance_embedder.linear_1.weight")
TOKENIZER_REPO = "black-forest-labs/FLUX.2-klein-4B"
# klein's fixed constants (diffusers' Flux2Transformer2DModel config of the klein checkpoints).
DIT_FACTS = {
    "_class_name": "Flux2Transformer2DModel",
    "patch_size": 1,
    "timestep_guidance_channels": 256,
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": False,
}
ROPE_AXES = 4  # the head splits into four equal RoPE axes (t, h, w, l)


def family(dit: Header) -> str | None:
    if not (dit.first_shape(MODULATION) and dit.first_shape(IMAGE_IN) and dit.first_shape(TEXT_IN)):
        return None
    if dit.first_shape(GUIDANCE):
        return None
    return FAMILY_9B if dit.count(*DOUBLE_STEMS) >= NINE_B_DOUBLE_BLOCKS else FAMILY_4B


def variant(dit: Header, name: str) -> str | None:
    return "base" if "base" in name else "distilled"


def joint_width(dit: Header) -> int:
    return dit.first_shape(TEXT_IN)[1]


def fits_encoder(dit: Header, encoder: Header) -> bool:
    width = qwen3_files.width(encoder)
    return (
        width is not None
        and len(TAPPED_LAYERS) * width == joint_width(dit)
        and (qwen3_files.layers(encoder) >= LOADED_LAYERS)
    )


fits_vae = vae_files.fits_flux2_vae


def dit_config(dit: Header) -> dict:
    return {
        **DIT_FACTS,
        "in_channels": dit.first_shape(IMAGE_IN)[1],
        "num_layers": dit.count(*DOUBLE_STEMS),
        "num_single_layers": dit.count(*SINGLE_STEMS),
        "joint_attention_dim": joint_width(dit),
        **flux_width_settings(dit, IMAGE_IN, QUERY_NORM, MLP_IN, ROPE_AXES),
    }


def configs(family: str, variant: str, dit: Header, encoder: Header, vae: Header) -> dict:
    from ...components import ComponentError

    width, layers = qwen3_files.width(encoder), qwen3_files.layers(encoder)
    if width is None or len(TAPPED_LAYERS) * width != joint_width(dit):
        raise ComponentError(
            f"{encoder.path} is not a Qwen3 text encoder {joint_width(dit) // len(TAPPED_LAYERS)}"
            f" wide, as the DiT {dit.path.name} takes ({TEXT_IN[0]} reads {len(TAPPED_LAYERS)}"
            f" layers of {joint_width(dit) // len(TAPPED_LAYERS)});"
            f" {qwen3_files.embedding_said(encoder)}"
        )
    if layers < LOADED_LAYERS:
        raise ComponentError(
            f"{encoder.path} has {layers} decoder layers; FLUX.2 klein reads the first"
            f" {LOADED_LAYERS}"
        )
    vae_config = vae_files.flux2_vae_config(vae)  # refused before the configs are told
    return {
        "model_index.json": model_index_of(family, variant),
        "transformer/config.json": dit_config(dit),
        "text_encoder/config.json": qwen3_files.config(encoder),
        "vae/config.json": vae_config,
        "scheduler/scheduler_config.json": SCHEDULER,
    }
