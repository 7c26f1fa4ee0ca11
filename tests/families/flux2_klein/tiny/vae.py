"""A tiny random FLUX.2 autoencoder (diffusers' AutoencoderKLFlux2: 32 latent channels, stride
8, quant convolutions, the batch norm over the 2x2-patchified latents), saved to a folder.
Weights get a full 1/sqrt(fan_in) spread, norm scales and biases noise, and the batch norm
running statistics of their own, so every part visibly moves the output."""

from __future__ import annotations

from pathlib import Path

TINY_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 32,
    "block_out_channels": (16, 32, 32, 32),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "batch_norm_eps": 1e-4,
    "patch_size": (2, 2),
}
CONSTANT_NOISE = 0.1


def build_vae(directory: Path, seed: int = 0, **overrides):
    """Build, perturb and save a tiny AutoencoderKLFlux2 into `directory`; return the model."""
    import torch
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    model = AutoencoderKLFlux2(**{**TINY_CONFIG, **overrides})
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
        channels = model.bn.running_mean.shape[0]
        model.bn.running_mean.copy_(0.3 * torch.randn(channels, generator=generator))
        model.bn.running_var.copy_(0.5 + torch.rand(channels, generator=generator))
    model.eval()
    model.save_pretrained(str(directory))
    return model
