"""Qwen-Image's VAE (diffusers' `AutoencoderKLQwenImage`, Krea 2's) in MLX, for single images.

It is Wan 2.1's VAE: the plain layout of the network in `qwen_image21.py` (is_residual false:
no averaging or duplicating shortcuts around the resamplers, the decoder's upsamplers halving the
channels), over three image channels at stride 8, with true 3D causal convolutions in its file.
On one frame a causal convolution of temporal kernel k sees only its last temporal slice (the
others fall on the zero frames padded in front), so each kernel is cut to that slice as it loads;
the resamplers' `time_conv` is never applied to a first frame (see qwen_image21.py). Tiling,
memory plans and the latent normalisation are that module's. A file in Wan's own names
(ComfyUI's `qwen_image_vae.safetensors`) reads as one in diffusers' (wan_names).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from . import wan_names
from .qwen_image21 import QwenImage21VAE, QwenImage21VAEPart, checkpoint_weights


def plain_config(config: dict) -> dict:
    """`AutoencoderKLQwenImage`'s config in the terms of qwen_image21.py's network."""
    channels = int(config.get("input_channels", 3))
    return {
        **config,
        "base_dim": config.get("base_dim", 96),
        "z_dim": config.get("z_dim", 16),
        "dim_mult": config.get("dim_mult", [1, 2, 4, 4]),
        "num_res_blocks": config.get("num_res_blocks", 2),
        "temperal_downsample": config.get("temperal_downsample", [False, True, True]),
        "in_channels": channels,
        "out_channels": channels,
        "is_residual": False,
        "latents_mean": config["latents_mean"],
        "latents_std": config["latents_std"],
    }


def causal_frame_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The file's 5-D convolution kernels (out, in, t, kh, kw) cut to their last temporal slice,
    the one a single frame meets; every other tensor as it is."""
    return {name: value[:, :, -1] if value.ndim == 5 else value for name, value in weights.items()}


class QwenImageVAE(QwenImage21VAE):
    """Encode images to raw latents (distribution mean) and decode raw latents to images, as
    `QwenImage21VAE` does; latents are (B, 16, H/8, W/8) in the VAE's own space."""

    def __init__(self, config: dict, dtype: mx.Dtype = mx.float32):
        super().__init__(plain_config(config), dtype)

    @staticmethod
    def mlx_weights(weights: dict[str, mx.array]) -> list[tuple[str, mx.array]]:
        """The file's tensors, in diffusers' names or Wan's (ComfyUI's file: wan_names)."""
        return checkpoint_weights(causal_frame_weights(wan_names.renamed(weights)))


class QwenImageVAEPart(QwenImage21VAEPart):
    """This VAE as a family's (family.FolderFamily's `vae`), as `QwenImage21VAEPart` with the
    config read in this layout's terms."""

    def load(self, vae_dir: Path, dtype: mx.Dtype) -> QwenImageVAE:
        return QwenImageVAE.load(vae_dir, dtype)

    @staticmethod
    def latent(config: dict) -> dict:
        """The VAE's own latent: its channels at its stride (the DiT reads them in patches)."""
        plain = plain_config(config)
        return {"channels": int(plain["z_dim"]), "stride": 2 ** (len(plain["dim_mult"]) - 1)}

    @staticmethod
    def channels_out(config: dict) -> int:
        return int(plain_config(config)["out_channels"])

    @staticmethod
    def status_row(config: dict) -> dict:
        return QwenImage21VAEPart.status_row(plain_config(config))

    @staticmethod
    def reserve_bytes(config: dict, pixels: int) -> int:
        return QwenImage21VAEPart.reserve_bytes(plain_config(config), pixels)
