"""FLUX.3 klein from its component files (engine/components.py): the DiT as one file in BFL's
names (its own checkpoints, `txt_mode_blocks.N.q_proj.weight`, ..., optionally under ComfyUI's
`model.diffusion_model.`; GGUF files converted from them) or diffusers' (`Flux3Transformer2DModel`),
Qwen3-VL's language model as one file (transformers' names, or llama.cpp's `qwen3vl` GGUF alone)
and FLUX.2's VAE (`flux2-vae.safetensors`). No MLX.

The DiT is told by its three token modes' embedders and the text mode's blocks. A flow map (the
distilled checkpoint) carries the target time's embedder, so the files tell the variant. The
tapped encoder layers are the pipelines' (`OUT_LAYERS`); a DiT whose text input is not that many
layers of the encoder's width cannot say which it reads and is refused.
"""

from __future__ import annotations

from ...config_keys import flux_width_settings
from ...encoders.qwen3 import files as qwen3_files
from ...file_headers import Header
from ...vaes import from_files as vae_files
from .layout import BFL_BLOCK, BFL_PREFIXES, bfl_name
from .spec import FAMILY, OUT_LAYERS, SCHEDULER_CONFIG, TRANSFORMER_CLASS, model_index_of

TOKENIZER_REPO = qwen3_files.VL_TOKENIZER_REPO
TOKENIZER_INCLUDE = qwen3_files.VL_TOKENIZER_INCLUDE
BFL_NORM = {name + ".weight": bfl + ".scale" for bfl, name in BFL_BLOCK.items() if "norm" in bfl}
ROPE_AXES = 4  # the head splits into four equal RoPE axes
# What the files cannot say: Flux3Transformer2DModel's config of the klein checkpoints.
DIT_FACTS = {"_class_name": TRANSFORMER_CLASS, "rope_theta": 10000, "eps": 1e-6}


def names(tensor: str) -> tuple[str, str]:
    """A tensor's diffusers name and BFL's (layout.bfl_name; a norm's scale is `.scale`)."""
    for diffusers, bfl in BFL_NORM.items():
        if tensor.endswith("." + diffusers):
            return tensor, tensor[: -len(diffusers)] + bfl
    return tensor, bfl_name(tensor.removesuffix(".weight")) + ".weight"


IMAGE_IN = names("x_embedders.image.weight")
COND_IN = names("x_embedders.image_cond.weight")
TEXT_IN = names("context_embedder.weight")
TIME_IN = names("timestep_embedder.linear_1.weight")
TARGET_IN = names("target_timestep_embedder.linear_1.weight")
QUERY_NORM = names("txt_mode_blocks.0.attn.norm_q.weight")
MLP_IN = names("txt_mode_blocks.0.ff.linear_in.weight")
MODE_STEMS = ("txt_mode_blocks.",)
SINGLE_STEMS = (
    "single_transformer_blocks.",
    *(b for b, d in BFL_PREFIXES.items() if d.startswith("single")),
)


def family(dit: Header) -> str | None:
    if dit.first_shape(IMAGE_IN) and dit.first_shape(COND_IN) and dit.first_shape(QUERY_NORM):
        return FAMILY
    return None


def variant(dit: Header, name: str) -> str | None:
    return "distilled" if dit.first_shape(TARGET_IN) else "base"


def text_width(dit: Header) -> int:
    return dit.first_shape(TEXT_IN)[1]


def fits_encoder(dit: Header, encoder: Header) -> bool:
    width = qwen3_files.vl_width(encoder)
    return width is not None and len(OUT_LAYERS) * width == text_width(dit)


fits_vae = vae_files.fits_flux2_vae


def dit_config(dit: Header) -> dict:
    return {
        **DIT_FACTS,
        "in_channels": dit.first_shape(IMAGE_IN)[1],
        "cond_in_channels": dit.first_shape(COND_IN)[1],
        "num_layers": dit.count(*MODE_STEMS),
        "num_single_layers": dit.count(*SINGLE_STEMS),
        "joint_attention_dim": text_width(dit),
        "timestep_channels": dit.first_shape(TIME_IN)[1],
        **flux_width_settings(dit, IMAGE_IN, QUERY_NORM, MLP_IN, ROPE_AXES),
        "flow_map": dit.first_shape(TARGET_IN) is not None,
    }


def configs(family: str, variant: str, dit: Header, encoder: Header, vae: Header) -> dict:

    transformer = dit_config(dit)
    taps = len(OUT_LAYERS)
    reader = f"the DiT {dit.path.name} ({TEXT_IN[0]}: the pipeline's {taps} tapped layers)"
    jad = transformer["joint_attention_dim"]
    text = qwen3_files.tapped_text_config(encoder, jad, taps, OUT_LAYERS, reader)
    vae_config = vae_files.flux2_vae_config(vae)  # refused before the configs are told
    return {
        "model_index.json": model_index_of(variant, OUT_LAYERS),
        "transformer/config.json": transformer,
        "text_encoder/config.json": {"model_type": "qwen3_vl", "text_config": text},
        "vae/config.json": vae_config,
        "scheduler/scheduler_config.json": SCHEDULER_CONFIG,
    }
