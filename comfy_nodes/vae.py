"""The remote VAE (docs/contract.md §7.4, §2.12, §2.13): decode and encode on the server.

Behaves like the parts of ComfyUI's `comfy.sd.VAE` that stock nodes use. Needs torch, not
ComfyUI.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gmlx_contract.errors import StepError
from gmlx_contract.wire import MAX_VAE_IMAGES

from .connection import Connection
from .errors import GmlxError


def crop_to_stride(pixels: torch.Tensor, stride: int) -> torch.Tensor:
    """Centre-crop (B, H, W, C) images to multiples of the stride, as ComfyUI's VAE does."""
    for dim in (1, 2):
        size = pixels.shape[dim]
        kept = (size // stride) * stride
        if kept != size:
            pixels = pixels.narrow(dim, (size % stride) // 2, kept)
    return pixels


def match_channels(pixels: torch.Tensor, channels: int) -> torch.Tensor:
    """Images with the VAE's channel count: a missing alpha is 1.0, extra channels dropped."""
    have = pixels.shape[-1]
    if have == channels:
        return pixels
    if have == 3 and channels == 4:
        alpha = torch.ones_like(pixels[..., :1])
        return torch.cat([pixels, alpha], dim=-1)
    return pixels[..., :channels]


def chunks(batch: int, size: int = MAX_VAE_IMAGES) -> list[slice]:
    """Slices of at most `size` images (the server's per-pass limit)."""
    return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]


class GmlxVAE:
    """A VAE whose passes run on the server; latents are in the VAE routes' space."""

    def __init__(self, conn: Connection, model_id: str, status: dict) -> None:
        vae = status.get("vae") or {}
        latent = status.get("latent") or {}
        self.conn = conn
        self.model_id = model_id
        self.latent_channels = int(latent.get("channels", 16))
        self.stride = int(vae.get("stride", 8))
        self.output_channels = int(vae.get("channels_out", 3))
        self.downscale_ratio = self.stride
        self.upscale_ratio = self.stride
        self.latent_dim = 2
        self.crop_input = True
        self.not_video = True

    # The ComfyUI VAE interface stock nodes call.
    def spacial_compression_decode(self) -> int:
        return self.stride

    def spacial_compression_encode(self) -> int:
        return self.stride

    def temporal_compression_decode(self) -> None:
        return None

    def throw_exception_if_invalid(self) -> None:
        return None

    def get_sd(self) -> dict:
        return {}

    def decode(self, samples: torch.Tensor, **_: Any) -> torch.Tensor:
        """Latents (B, C, h, w) -> images (B, H, W, 3 or 4) float32 in [0, 1]."""
        if samples.ndim == 5 and samples.shape[2] == 1:  # a single-frame video latent
            samples = samples[:, :, 0]
        latents = samples.detach().to("cpu", torch.float32).contiguous().numpy()
        alpha = self.output_channels == 4
        parts = [
            self._server(
                "decode",
                lambda p=p: self.conn.client.vae_decode(
                    latents[p], model=self.model_id, alpha=alpha
                ),
            )
            for p in chunks(latents.shape[0])
        ]
        return torch.from_numpy(np.concatenate([np.array(p) for p in parts], axis=0))

    def encode(self, pixels: torch.Tensor, **_: Any) -> torch.Tensor:
        """Images (B, H, W, C) in [0, 1] -> latents (B, C, h, w) float32."""
        pixels = match_channels(crop_to_stride(pixels, self.stride), self.output_channels)
        images = pixels.detach().to("cpu", torch.float32).contiguous().numpy()
        parts = [
            self._server(
                "encode", lambda p=p: self.conn.client.vae_encode(images[p], model=self.model_id)
            )
            for p in chunks(images.shape[0])
        ]
        return torch.from_numpy(np.concatenate([np.array(p) for p in parts], axis=0))

    # Tiled calls are plain calls: the server tiles by itself (feature `tiled_vae`).
    def decode_tiled(self, samples: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.decode(samples)

    def encode_tiled(self, pixels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.encode(pixels)

    def _server(self, what: str, call):
        with self.conn.lock:
            try:
                return call()
            except StepError as err:
                raise GmlxError(f"{err} (VAE {what} of {self.model_id!r})") from err
