"""diffusers' `AutoencoderKLFlux2` in MLX (the FLUX.2 autoencoder), for single images.

The body is the classic KL autoencoder (autoencoder_kl.py: 32 latent channels at stride 8, its
quant convolutions). What FLUX.2 adds is the latent space its DiT works in, and that the VAE
routes carry too (status `vae.space` "model"): the raw latent patchified 2x2 into 128 channels
at stride 16 (channel c*4 + 2*dy + dx), then normalised by the checkpoint's batch-norm running
statistics, (z - running_mean) / sqrt(running_var + batch_norm_eps), as Flux2KleinPipeline
encodes references and decodes its result.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..base import EngineInputError
from ..weights import estimated_bytes, load_weights, read_config
from .autoencoder_kl import AutoencoderKL, AutoencoderKLPart

# Config keys that change nothing the network computes (engine/config_keys.py; the body's
# are autoencoder_kl.py's).
NOT_READ = {"batch_norm_momentum": "the running statistics' update in training"}
BATCH_NORM = "bn."
BATCH_NORM_STATS = ("bn.running_mean", "bn.running_var")


class AutoencoderKLFlux2:
    """Encode images to model-space latents (B, 4*latent, H/16, W/16) and decode them."""

    def __init__(self, config: dict, dtype: mx.Dtype = mx.float32):
        patch = tuple(config.get("patch_size", (2, 2)))
        if patch != (2, 2):
            raise ValueError(f"FLUX.2's VAE patchifies 2x2, got patch_size {patch}")
        self.config = config
        self.dtype = dtype
        # Flux2KleinPipeline never tiles its VAE: every image runs whole.
        self.body = AutoencoderKL(config, dtype, tiles=False)
        self.eps = float(config.get("batch_norm_eps", 1e-4))
        self.raw_channels = self.body.latent_channels
        self.latent_channels = 4 * self.raw_channels
        self.in_channels = self.body.in_channels
        self.out_channels = self.body.out_channels
        self.stride = 2 * self.body.stride
        self.mean = mx.zeros((self.latent_channels,), mx.float32)
        self.std = mx.ones((self.latent_channels,), mx.float32)
        self.weight_bytes = 0

    @classmethod
    def load(cls, vae_dir: Path, dtype: mx.Dtype = mx.float32) -> AutoencoderKLFlux2:
        vae = cls(read_config(Path(vae_dir)), dtype)
        files = load_weights(Path(vae_dir), dtype, keep_f32=lambda name: name in BATCH_NORM_STATS)
        vae.load_weights(files)
        return vae

    def load_weights(self, weights: dict[str, mx.array]) -> None:
        """The checkpoint's weights by file name: the body's, and the batch norm's statistics
        (its step counter is unused)."""
        missing = [name for name in BATCH_NORM_STATS if name not in weights]
        if missing:
            raise ValueError(f"VAE weights lack the batch-norm statistics {missing}")
        mean = weights["bn.running_mean"].astype(mx.float32)
        var = weights["bn.running_var"].astype(mx.float32)
        if mean.shape != (self.latent_channels,) or var.shape != (self.latent_channels,):
            raise ValueError(
                f"the batch norm holds {mean.shape[0]} channels; the VAE's patchified latents"
                f" have {self.latent_channels}"
            )
        self.mean, self.std = mean, mx.sqrt(var + self.eps)
        self.body.load_weights({n: v for n, v in weights.items() if not n.startswith(BATCH_NORM)})
        self.weight_bytes = self.body.weight_bytes + mean.nbytes + var.nbytes

    # The VAE routes carry model space: nothing to convert.

    def to_model_space(self, latents: mx.array) -> mx.array:
        return latents

    def from_model_space(self, latents: mx.array) -> mx.array:
        return latents

    # Passes.

    def tileable(self, height: int, width: int, decode: bool) -> bool:
        """Never: every image runs whole (its pipeline never tiles it)."""
        return False

    def encode(self, image: mx.array, tiled: bool = False) -> mx.array:
        """(B, H, W, C) in [0, 1], H and W multiples of 16 -> (B, 4*latent, H/16, W/16), whole
        (`tiled` has nothing to ask: `tileable`)."""
        if image.ndim == 4:
            height, width = image.shape[1:3]
            if height % self.stride or width % self.stride:
                raise EngineInputError(
                    f"image size {width}x{height} is not a multiple of the VAE stride {self.stride}"
                )
        raw = self.body.encode(image)
        return (self.patchify(raw) - self.mean[:, None, None]) / self.std[:, None, None]

    def decode(self, latents: mx.array, tiled: bool = False) -> mx.array:
        """(B, 4*latent, h, w) model-space latents -> (B, 16h, 16w, out_channels) in [0, 1],
        whole."""
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels or 0 in latents.shape:
            raise EngineInputError(
                f"latents are (B, {self.latent_channels}, h, w) for this VAE; got shape"
                f" {latents.shape}"
            )
        raw = latents.astype(mx.float32) * self.std[:, None, None] + self.mean[:, None, None]
        return self.body.decode(self.unpatchify(raw))

    def peak_bytes(self, height: int, width: int, decode: bool, tiled: bool = False) -> int:
        return self.body.peak_bytes(height, width, decode)

    @staticmethod
    def patchify(z: mx.array) -> mx.array:
        """(B, C, H, W) -> (B, 4C, H/2, W/2), channel c*4 + 2*dy + dx."""
        batch, channels, height, width = z.shape
        z = z.reshape(batch, channels, height // 2, 2, width // 2, 2).transpose(0, 1, 3, 5, 2, 4)
        return z.reshape(batch, channels * 4, height // 2, width // 2)

    @staticmethod
    def unpatchify(z: mx.array) -> mx.array:
        batch, channels, height, width = z.shape
        z = z.reshape(batch, channels // 4, 2, 2, height, width).transpose(0, 1, 4, 2, 5, 3)
        return z.reshape(batch, channels // 4, height * 2, width * 2)


def loaded_tensor(name: str) -> bool:
    """Whether a load holds the file tensor `name`: every one but the batch norm's step
    counter (for weights.estimated_bytes)."""
    return not name.startswith(BATCH_NORM) or name in BATCH_NORM_STATS


def latent_facts(config: dict) -> dict:
    """The model-space latent's channels and stride of a VAE config (no weights read)."""
    return {
        "channels": 4 * int(config.get("latent_channels", 32)),
        "stride": 2 ** len(config.get("block_out_channels", (0, 0, 0, 0))),
    }


class AutoencoderKLFlux2Part(AutoencoderKLPart):
    """This VAE as a family's (family.FolderFamily's `vae`): the latents and the VAE routes in
    the DiT's model space, the batch norm's step counter never loaded, never tiled."""

    def load(self, vae_dir: Path, dtype: mx.Dtype) -> AutoencoderKLFlux2:
        """The VAE's network from its folder, computing in `dtype`."""
        return AutoencoderKLFlux2.load(vae_dir, dtype)

    def __init__(self) -> None:
        super().__init__(tiles=False)  # Flux2KleinPipeline never tiles its VAE

    def latent(self, config: dict) -> dict | None:
        return latent_facts(config)

    def status_row(self, config: dict) -> dict:
        """The VAE routes carry the DiT's model space (docs/contract.md §2.12)."""
        return {"space": "model"}

    def estimate(self, vae_dir: Path, dtype: mx.Dtype) -> int:
        return estimated_bytes(vae_dir, dtype, loaded_tensor)
