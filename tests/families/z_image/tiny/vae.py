"""A tiny random FLUX.1 autoencoder (diffusers' AutoencoderKL in Z-Image's configuration: 16
latent channels, stride 8, no quant convolutions, its scaling and shift factors), saved to a
folder. Weights get a full 1/sqrt(fan_in) spread and norm scales and biases noise, so every layer
visibly moves the output."""

from __future__ import annotations

from pathlib import Path

TINY_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": (16, 32, 32, 32),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2,
    "norm_num_groups": 8,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "sample_size": 1024,  # FLUX.1's: images up to 1024 pixels are not tiled
}
CONSTANT_NOISE = 0.1


def build_vae(directory: Path, seed: int = 0, **overrides):
    """Build, perturb and save a tiny AutoencoderKL into `directory`; return the torch model."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    model = AutoencoderKL(**{**TINY_CONFIG, **overrides})
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim >= 2:
                param.copy_(noise / param[0].numel() ** 0.5)
            elif name.endswith("weight"):
                param.copy_(1.0 + CONSTANT_NOISE * noise)
            else:
                param.copy_(CONSTANT_NOISE * noise)
    model.eval()
    model.save_pretrained(str(directory))
    return model
