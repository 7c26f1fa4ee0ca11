"""The remote VAE (docs/contract.md §7.4, §2.12, §2.13): decode and encode on the server.

Behaves like the parts of ComfyUI's `comfy.sd.VAE` that stock nodes use: `decode` gives RGB, as
ComfyUI's IMAGE is; `decode_with_alpha` also gives a four-channel VAE's alpha. Each image is
one request, sent only while ComfyUI's interrupt flag is clear; an interrupt while one is in
flight is raised at once. The server then finishes that image (it tiles large images itself, and
a VAE pass has no run to interrupt) and is sent no further one. Needs torch; reads ComfyUI's
interrupt flag only when a pass runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gmlx_contract.errors import StepError

from .connection import Connection, RemotePart
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


class GmlxVAE(RemotePart):
    """A VAE whose passes run on the server; latents are in the VAE routes' space."""

    def __init__(self, conn: Connection, model_id: str, status: dict) -> None:
        super().__init__(conn, model_id)
        vae = status.get("vae") or {}
        latent = status.get("latent") or {}
        self.latent_channels = int(latent.get("channels", 16))
        self.channels_stated = "channels" in latent  # what a decode's latents are checked by
        self.stride = int(vae.get("stride", 8))
        # the pixels a side must be a multiple of: a latent cell, times the DiT's patch (2 for
        # Z-Image at stride 8: 16 pixels)
        self.size_multiple = self.stride * int(latent.get("patch", 1))
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

    @property
    def has_alpha(self) -> bool:
        return self.output_channels == 4

    def decode(self, samples: torch.Tensor, **_: Any) -> torch.Tensor:
        """Latents (B, C, h, w) -> RGB images (B, H, W, 3) float32 in [0, 1]."""
        return self._decode(samples, alpha=False)

    def decode_with_alpha(self, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RGB images (B, H, W, 3) and their alpha (B, H, W) in [0, 1]; None without one."""
        if not self.has_alpha:
            return self._decode(samples, alpha=False), None
        rgba = self._decode(samples, alpha=True)
        return rgba[..., :3].contiguous(), rgba[..., 3].contiguous()

    def _decode(self, samples: torch.Tensor, alpha: bool) -> torch.Tensor:
        if samples.ndim == 5 and samples.shape[2] == 1:  # a single-frame video latent
            samples = samples[:, :, 0]
        self._check_channels(samples)
        latents = samples.detach().to("cpu", torch.float32).contiguous().numpy()
        return self._each(
            "decode",
            latents,
            lambda one: self.conn.client.vae_decode(one, model=self.model_id, alpha=alpha),
        )

    def _check_channels(self, samples: torch.Tensor) -> None:
        """Refuse, before any request, what the VAE cannot decode: another shape than (B, C, h,
        w), or a latent of another model's channel count (what the user has to change is then
        the VAE, or the latent, not the latent's shape)."""
        if samples.ndim != 4:
            raise GmlxError(
                f"gmlx: the VAE of {self.model_id!r} decodes latents of (batch, channels,"
                f" height, width), or one frame of a video latent; got {tuple(samples.shape)}"
            )
        if self.channels_stated and samples.shape[1] != self.latent_channels:
            raise GmlxError(
                f"gmlx: this latent ({tuple(samples.shape)}) is not {self.model_id!r}'s: its"
                f" VAE takes latents of {self.latent_channels} channels. The latent was made by"
                " another model; decode it with the VAE of the model that sampled it (the gmlx"
                " VAE Loader set to that model)"
            )

    def encode(self, pixels: torch.Tensor, **_: Any) -> torch.Tensor:
        """Images (B, H, W, C) in [0, 1] -> latents (B, C, h, w) float32."""
        pixels = match_channels(crop_to_stride(pixels, self.stride), self.output_channels)
        images = pixels.detach().to("cpu", torch.float32).contiguous().numpy()
        return self._each(
            "encode", images, lambda one: self.conn.client.vae_encode(one, model=self.model_id)
        )

    # Tiled calls are plain calls: the server tiles by itself (feature `tiled_vae`).
    def decode_tiled(self, samples: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.decode(samples)

    def encode_tiled(self, pixels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.encode(pixels)

    def _each(self, what: str, batch: np.ndarray, call) -> torch.Tensor:
        """`call` on each image of the batch in turn, one request each, interruptible."""
        self.conn.ensure_reachable()
        parts = []
        for i in range(batch.shape[0]):
            try:
                part = self.call(lambda i=i: call(batch[i : i + 1]))
            except StepError as err:
                raise GmlxError(f"{err} (VAE {what} of {self.model_id!r})") from err
            parts.append(np.asarray(part, dtype=np.float32))
        return torch.from_numpy(np.concatenate(parts, axis=0))
