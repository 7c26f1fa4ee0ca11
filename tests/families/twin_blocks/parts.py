"""The twin-blocks family's own prompt encoder and VAE (tiny, but real MLX arithmetic on
checkpoint weights): bytes -> rows of an embedding table; 8x8 pixel patches <-> latents by a
linear map each way."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from gmlx_server.engine.weights import load_weights, read_config


class ByteEncoder:
    """text -> (1, L, D): one row of `embed` per UTF-8 byte (a space for an empty prompt)."""

    def __init__(self, embed: mx.array):
        self.embed = embed
        self.weight_bytes = embed.nbytes

    @classmethod
    def load(cls, component_dir: Path) -> ByteEncoder:
        return cls(load_weights(component_dir, mx.float32)["embed.weight"])

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer((text or " ").encode("utf-8"), dtype=np.uint8).astype(np.int32)
        return np.array(self.embed[mx.array(codes)][None])


class PatchVAE:
    """RGB images (1, H, W, 3) in [0, 1] <-> raw latents (1, C, H/8, W/8); the DiT's model space
    is raw latents times `scale`."""

    def __init__(self, config: dict, weights: dict[str, mx.array]):
        self.stride = int(config["stride"])
        self.out_channels = 3
        self.scale = float(config["scaling_factor"])
        self.encoder, self.decoder = weights["encoder.weight"], weights["decoder.weight"]
        self.channels = self.encoder.shape[0]
        self.weight_bytes = self.encoder.nbytes + self.decoder.nbytes

    @classmethod
    def load(cls, component_dir: Path) -> PatchVAE:
        return cls(read_config(component_dir), load_weights(component_dir, mx.float32))

    def encode(self, image: mx.array) -> mx.array:
        _, height, width, _ = image.shape
        s, h, w = self.stride, height // self.stride, width // self.stride
        patches = image[:, : h * s, : w * s, :3].reshape(1, h, s, w, s, 3)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(1, h * w, s * s * 3)
        latents = patches @ self.encoder.T  # (1, h*w, C)
        return latents.transpose(0, 2, 1).reshape(1, self.channels, h, w)

    def decode(self, latents: mx.array) -> mx.array:
        _, channels, h, w = latents.shape
        s = self.stride
        patches = latents.reshape(1, channels, h * w).transpose(0, 2, 1) @ self.decoder.T
        image = patches.reshape(1, h, w, s, s, 3).transpose(0, 1, 3, 2, 4, 5)
        return mx.clip(image.reshape(1, h * s, w * s, 3), 0.0, 1.0)

    def to_model_space(self, latents: mx.array) -> mx.array:
        return latents * self.scale

    def from_model_space(self, latents: mx.array) -> mx.array:
        return latents / self.scale

    def peak_bytes(self, height: int, width: int, decode: bool) -> int:
        """The image, its patches and the latents in float32, twice over (inputs and results)."""
        pixels = height * width
        return 2 * 4 * (2 * pixels * 3 + pixels // self.stride**2 * self.channels)
