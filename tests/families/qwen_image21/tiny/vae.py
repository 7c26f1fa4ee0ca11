"""A tiny random Qwen-Image 2.1 VAE (diffusers' AutoencoderKLQwenImage21), saved to a folder.

Five `dim_mult` entries give the pipeline's fixed spatial factor 16; the in and out channels are 4
(RGBA) as in the real VAE; `temperal_downsample` (the config's spelling) mixes False and True so
both shortcut forms are built. The RMS-norm gains start at one, so they get a little noise before
saving, and latents_mean/std are drawn away from 0 and 1 so the normalisation is visible.
"""

from __future__ import annotations

from pathlib import Path

TINY_CONFIG = {
    "base_dim": 8,
    "decoder_base_dim": 12,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 4, 4],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True, True],
    "in_channels": 4,
    "out_channels": 4,
}

# Spread given to parameters that start constant (the RMS-norm gains).
CONSTANT_NOISE = 0.1


def tiny_config(**overrides) -> dict:
    config = dict(TINY_CONFIG)
    config.update(overrides)
    return config


def build_vae(directory: Path, seed: int = 0, **config_overrides):
    """Build, perturb and save a tiny VAE into `directory`; return the torch model (eval mode)."""
    import torch
    from diffusers import AutoencoderKLQwenImage21

    config = tiny_config(**config_overrides)
    generator = torch.Generator().manual_seed(seed + 1)
    z_dim = config["z_dim"]
    if "latents_mean" not in config_overrides:
        config["latents_mean"] = (torch.randn(z_dim, generator=generator) * 0.5).tolist()
    if "latents_std" not in config_overrides:
        config["latents_std"] = (0.5 + torch.rand(z_dim, generator=generator) * 2.0).tolist()

    torch.manual_seed(seed)
    model = AutoencoderKLQwenImage21(**config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gamma"):
                param.add_(torch.randn(param.shape, generator=generator) * CONSTANT_NOISE)
    model.eval()
    model.save_pretrained(str(directory))
    return model
