"""MOSS-Image from its component files (engine/components.py): the DiT as one file in upstream's
`MOSSImageTransformer` names (safetensors, or a GGUF file converted from it; no ComfyUI has
MOSS-Image, so no other naming exists), Qwen3.5's language model as llama.cpp's `qwen35` GGUF
file (whose metadata says its every size: encoders/qwen35/files.py; a safetensors file of it
cannot say its RoPE base), and FLUX.2's VAE with MOSS-Image's narrower decoder (diffusers' or
the ldm names). No MLX.

The DiT is told by its text projection's fused qkv and its main blocks' fused feed-forward with
the shared modulation. SFT and base have the same shapes: the DiT file's name says `base`, else
it is `sft` (the two sample alike).
"""

from __future__ import annotations

from ...encoders.qwen35 import files as qwen35_files
from ...file_headers import Header
from ...vaes import from_files as vae_files
from .layout import BLOCK_LINEARS, BLOCK_NORMS, STACKS, TEXT_BLOCK_LINEARS, TOP_LINEARS
from .spec import FAMILY, MODEL_INDEX, TRANSFORMER_CLASS

# Where its tokenizer is published: upstream's checkpoint (its tokenizer/ folder).
TOKENIZER_REPO = "OpenMOSS-Team/MOSS-Image-SFT"
IMAGE_IN = TOP_LINEARS["video_in"] + ".weight"
TEXT_IN = TOP_LINEARS["text_in"] + ".weight"
TIME_IN = TOP_LINEARS["time_1"] + ".weight"
MODULATION = TOP_LINEARS["modulation"] + ".weight"
BLOCKS = STACKS["blocks"].partition("{}")[0]  # `layers.`
TEXT_QKV = STACKS["text_blocks"].format(0) + TEXT_BLOCK_LINEARS["qkv"][0] + ".weight"
FFN_DOWN = STACKS["blocks"].format(0) + BLOCK_LINEARS["down"][0] + ".weight"
QUERY_NORM = STACKS["blocks"].format(0) + BLOCK_NORMS["norm_q"] + ".weight"
# What the files cannot say: MOSSImageTransformer's RoPE base.
DIT_FACTS = {"_class_name": TRANSFORMER_CLASS, "rope_base": 10000.0}


def family(dit: Header) -> str | None:
    if dit.has(IMAGE_IN, TEXT_IN, MODULATION, TEXT_QKV, FFN_DOWN, QUERY_NORM):
        return FAMILY
    return None


def variant(dit: Header, name: str) -> str | None:
    return "base" if "base" in name.lower() else "sft"


def fits_encoder(dit: Header, encoder: Header) -> bool:
    return qwen35_files.width(encoder) == dit.shape(TEXT_IN)[1]


fits_vae = vae_files.fits_flux2_vae


def dit_config(dit: Header) -> dict:
    dim, latent_channels = dit.shape(IMAGE_IN)
    head_dim = dit.shape(QUERY_NORM)[0]
    return {
        **DIT_FACTS,
        "dim": dim,
        "ffn_dim": dit.shape(FFN_DOWN)[1],
        "num_heads": dim // head_dim,
        "num_layers": dit.count(BLOCKS),
        "text_dim": dit.shape(TEXT_IN)[1],
        "freq_dim": dit.shape(TIME_IN)[1],
        "latent_channels": latent_channels,
    }


def configs(family: str, variant: str, dit: Header, encoder: Header, vae: Header) -> dict:
    from ...components import ComponentError

    transformer = dit_config(dit)
    width = qwen35_files.width(encoder)
    if width != transformer["text_dim"]:
        raise ComponentError(
            f"{encoder.path} is not llama.cpp's Qwen3.5 text encoder {transformer['text_dim']}"
            f" wide, as the DiT {dit.path.name} takes ({TEXT_IN})"
            + ("" if width is None else f"; its language model is {width} wide")
        )
    vae_config = vae_files.flux2_vae_config(vae)  # refused before the configs are told
    return {
        "model_index.json": MODEL_INDEX,
        "transformer/config.json": transformer,
        "text_encoder/config.json": qwen35_files.config(encoder),
        "vae/config.json": vae_config,
    }
