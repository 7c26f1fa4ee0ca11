"""A tiny random FLUX.1 autoencoder (diffusers' AutoencoderKL in Z-Image's configuration: 16
latent channels, stride 8, no quant convolutions, its scaling and shift factors, 1024-pixel
tiles) in a folder: the embedded Z-Image's recipe (server/engine/families/z_image/embedded.py),
loaded back as the diffusers reference."""

from __future__ import annotations

from pathlib import Path

from gmlx_server.engine.families.z_image import embedded


def build_vae(directory: Path, seed: int = 0, **overrides):
    """Write a tiny AutoencoderKL (`overrides`: of its config) into `directory`; return it as
    the diffusers model."""
    from diffusers import AutoencoderKL

    embedded.write_vae(Path(directory), seed, **overrides)
    return AutoencoderKL.from_pretrained(str(directory)).eval()
