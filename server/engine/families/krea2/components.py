"""Krea 2 from its component files (engine/components.py): the DiT as one file in diffusers'
`Krea2Transformer2DModel` names (safetensors, or a GGUF file converted from it: no ComfyUI
has Krea 2, so no other naming exists), Qwen3-VL's language model as one file (transformers'
names under `model.language_model.` or `language_model.`, the vision tower's tensors left
unread; or llama.cpp's `qwen3vl` GGUF, no mmproj needed), and Qwen-Image's VAE (ComfyUI's
`qwen_image_vae.safetensors` in Wan 2.1's names, or diffusers'). No MLX.

The DiT is told by its text fusion (`text_fusion.projector.weight`) with the gated main blocks'
modulation tables. Turbo and raw have the same shapes: the file's name says which (`turbo`,
`raw`), else the model entry must (`variant`). The tapped encoder layers are the pipeline's
(`SELECT_LAYERS`); a DiT that fuses another number of layers cannot say which it reads and is
refused.
"""

from __future__ import annotations

from ...encoders.qwen3 import files as qwen3_files
from ...file_headers import Header
from ...vaes import from_files as vae_files
from . import layout
from .spec import FAMILY, SCHEDULER_CONFIG, SELECT_LAYERS, model_index_of

# Where its tokenizer is published: Qwen3-VL's own.
TOKENIZER_REPO = qwen3_files.VL_TOKENIZER_REPO
TOKENIZER_INCLUDE = qwen3_files.VL_TOKENIZER_INCLUDE
# The tensors it is told and its config read from, by diffusers name (layout.py's tables).
PROJECTOR = layout.PROJECTOR + ".weight"
IMG_IN = layout.TOP_LINEARS["img_in"] + ".weight"
TXT_IN = layout.TOP_LINEARS["txt_in_1"] + ".weight"
TIME_IN = layout.TOP_LINEARS["time_1"] + ".weight"
BLOCK = layout.STACKS["blocks"].format(0)  # a main block's, and a text block's below
TEXT_BLOCK = layout.STACKS["layerwise"].format(0)
QUERY_NORM = layout.BLOCK_NORMS["norm_q"] + ".weight"
GATE = layout.BLOCK_LINEARS["q_gate"][1] + ".weight"
# The tensor that gives a Qwen-Image VAE's latent channels, in both its namings.
VAE_CONV_IN = "decoder.conv_in.weight (Wan's decoder.conv1.weight)"
KEY = layout.BLOCK_LINEARS["kv"][0] + ".weight"
FF_GATE = layout.BLOCK_LINEARS["gate_up"][0] + ".weight"
# RoPE axes split the head as 1/4, 3/8, 3/8 (Krea2Transformer2DModel's 32:48:48 of 128); the
# RoPE base and the norm epsilon are its config's defaults.
AXES_SHARES = (1 / 4, 3 / 8, 3 / 8)
DIT_FACTS = {"_class_name": "Krea2Transformer2DModel", "rope_theta": 1000.0, "norm_eps": 1e-5}
VAE_FACTS = {"_class_name": "AutoencoderKLQwenImage", **vae_files.QWEN_IMAGE_LATENTS}


def stem(stack: str) -> str:
    """A block stack's name stem (`transformer_blocks.` of `transformer_blocks.{}.`)."""
    return layout.STACKS[stack].partition("{}")[0]


def family(dit: Header) -> str | None:
    if dit.has(PROJECTOR, IMG_IN, TXT_IN, BLOCK + layout.MODULATION_TABLE, BLOCK + GATE):
        return FAMILY
    return None


def fits_encoder(dit: Header, encoder: Header) -> bool:
    return qwen3_files.vl_width(encoder) == dit.shape(TXT_IN)[1]


def fits_vae(dit: Header, vae: Header) -> bool:
    return vae_files.qwen_image_latent_channels(vae) == dit.shape(IMG_IN)[1] // 4


def dit_config(dit: Header) -> dict:
    hidden, in_channels = dit.shape(IMG_IN)
    head_dim = dit.shape(BLOCK + QUERY_NORM)[0]
    text_dim = dit.shape(TXT_IN)[1]
    text_head_dim = dit.shape(TEXT_BLOCK + QUERY_NORM)[0]
    return {
        **DIT_FACTS,
        "in_channels": in_channels,
        "num_layers": dit.count(stem("blocks")),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "num_key_value_heads": dit.shape(BLOCK + KEY)[0] // head_dim,
        "intermediate_size": dit.shape(BLOCK + FF_GATE)[0],
        "timestep_embed_dim": dit.shape(TIME_IN)[1],
        "text_hidden_dim": text_dim,
        "num_text_layers": dit.shape(PROJECTOR)[1],
        "text_num_attention_heads": text_dim // text_head_dim,
        "text_num_key_value_heads": dit.shape(TEXT_BLOCK + KEY)[0] // text_head_dim,
        "text_intermediate_size": dit.shape(TEXT_BLOCK + FF_GATE)[0],
        "num_layerwise_text_blocks": dit.count(stem("layerwise")),
        "num_refiner_text_blocks": dit.count(stem("refiner")),
        "axes_dims_rope": [round(head_dim * share) for share in AXES_SHARES],
    }


def configs(family: str, variant: str, dit: Header, encoder: Header, vae: Header) -> dict:
    from ...components import ComponentError

    transformer = dit_config(dit)
    if transformer["num_text_layers"] != len(SELECT_LAYERS):
        raise ComponentError(
            f"{dit.path.name} fuses {transformer['num_text_layers']} text encoder layers"
            f" ({PROJECTOR}); Krea 2's pipeline taps {len(SELECT_LAYERS)}, and the files do not"
            " say which others; serve it from a folder whose model_index.json names them"
            " (text_encoder_select_layers)"
        )
    reader = f"the DiT {dit.path.name} ({TXT_IN})"
    width = transformer["text_hidden_dim"]
    text = qwen3_files.tapped_text_config(encoder, width, 1, SELECT_LAYERS, reader)
    channels = vae_files.qwen_image_latent_channels(vae)
    if channels != transformer["in_channels"] // 4:
        raise ComponentError(
            f"{vae.path} is not the {transformer['in_channels'] // 4}-channel Qwen-Image VAE"
            f" that Krea 2 decodes with ({vae_files.channels_said(channels, VAE_CONV_IN)})"
        )
    return {
        "model_index.json": model_index_of(variant, SELECT_LAYERS),
        "transformer/config.json": transformer,
        "text_encoder/config.json": {"model_type": "qwen3_vl", "text_config": text},
        "vae/config.json": vae_files.qwen_image_config(vae, VAE_FACTS),
        "scheduler/scheduler_config.json": SCHEDULER_CONFIG,
    }
