"""A tiny random Z-Image DiT (diffusers' ZImageTransformer2DModel), saved to a folder.

Default initialisation leaves the caption with little influence on the output and the pad
tokens at zero, too little for a parity test to notice a broken text path. So linear weights are
re-drawn larger and constant-initialised parameters (norm weights, biases, pad tokens) get noise
before saving.
"""

from __future__ import annotations

from pathlib import Path

from ...tiny_weights import redraw

TINY_CONFIG = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 64,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": 32,
    "axes_dims": (8, 12, 12),
    "axes_lens": (256, 64, 64),
}

# Linear weights ~ N(0, (LINEAR_GAIN / sqrt(fan_in))^2); default kaiming-uniform is
# 1 / sqrt(3 fan_in).
LINEAR_GAIN = 1.0
# Spread given to parameters that start constant (ones or zeros).
CONSTANT_NOISE = 0.3


def tiny_config(**overrides) -> dict:
    config = dict(TINY_CONFIG)
    config.update(overrides)
    return config


def build_transformer(directory: Path, seed: int = 0, **config_overrides):
    """Build, perturb and save a tiny transformer into `directory`; return the torch model."""
    import torch
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(**tiny_config(**config_overrides))
    generator = torch.Generator().manual_seed(seed + 1)
    redraw(
        model,
        generator,
        LINEAR_GAIN,
        CONSTANT_NOISE,
        is_linear=lambda name, param: param.ndim == 2 and not name.endswith("pad_token"),
    )
    model.eval()
    model.save_pretrained(str(directory))
    return model
