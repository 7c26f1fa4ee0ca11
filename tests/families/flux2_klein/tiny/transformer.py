"""A tiny random FLUX.2 klein DiT (diffusers' Flux2Transformer2DModel), saved to a folder.

Default initialisation leaves the caption and the references with little influence on the
output, too little for a parity test to notice a broken path, so the weights are re-drawn by
tests/families/tiny_weights.py before saving.
"""

from __future__ import annotations

from pathlib import Path

from ...tiny_weights import redraw

TINY_CONFIG = {
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 96,  # three tapped layers of the tiny 32-wide text encoder
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": (8, 8, 8, 8),
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": False,
}
# The 9B DiT's depth in double-stream blocks: a tiny 9B folder has as many (identify reads it).
NINE_B_DOUBLE_BLOCKS = 8

LINEAR_GAIN = 1.0
CONSTANT_NOISE = 0.3


def tiny_config(**overrides) -> dict:
    return {**TINY_CONFIG, **overrides}


def build_transformer(directory: Path, seed: int = 0, **config_overrides):
    """Build, perturb and save a tiny transformer into `directory`; return the torch model."""
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**tiny_config(**config_overrides))
    redraw(model, torch.Generator().manual_seed(seed + 1), LINEAR_GAIN, CONSTANT_NOISE)
    model.eval()
    model.save_pretrained(str(directory))
    return model
