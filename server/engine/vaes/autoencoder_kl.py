"""diffusers' `AutoencoderKL` in MLX (the FLUX.1 autoencoder and its kin), for single images.

The classic KL autoencoder: ResNet down and up blocks, one self-attention in each mid block,
a 2x2-strided encoder and a nearest-upsampling decoder. Its config names the sizes
(`block_out_channels`, `layers_per_block`, `norm_num_groups`, `latent_channels`) and the latent
normalisation a DiT sees: model space is (z - shift_factor) * scaling_factor, where z is the
VAE's own latent (what the VAE routes carry).

Arrays are channels-last (NHWC) inside; the public methods take and give the layouts of
engine/family.py: images (B, H, W, C) in [0, 1], latents (B, C, h, w). Encoding returns the
posterior's mean. Images are processed one at a time.

Every image runs whole unless the pass is asked to tile (`tiled=True`: what the memory plan asks
for an image whose whole pass does not fit, as ComfyUI falls back to tiles on out-of-memory).
An image larger than the config's `sample_size` (1024 pixels for FLUX.1) may then be processed
in tiles, as diffusers' `AutoencoderKL` does once `enable_tiling()` is on (`tiled_encode`,
`tiled_decode`): square tiles of `sample_size` pixels (`sample_size / stride` latent cells),
a quarter of which overlaps the next tile, each run through the whole network on its own and
blended into its upper and left neighbours linearly across the overlap. The group norms and the
mid-block attention then see one tile, not the whole image, so a tiled pass is not the untiled
one (the tiles' statistics differ); it is diffusers' tiled pass, up to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base import EngineInputError
from ..config_keys import all_of, check_fixed
from ..nn.attention import chunked_attention
from ..weights import estimated_bytes
from . import ldm_names
from .checkpoint import CheckpointVAE

NORM_EPS = 1e-6
# The peak of one pass, in buffers of its widest full-resolution activation (the encoder's first
# block, the decoder's last upsampler): the activation, its norm and SiLU, a convolution's taps
# (Conv3x3) and the residual sums. Measured on the CPU backend on the tiny checkpoint
# (tests/vaes/autoencoder_kl/test_estimates.py): about 12.2 and 9.5.
ENCODE_BUFFERS = 14
DECODE_BUFFERS = 11
# diffusers' tiling: the config's sample_size (its default 32) is the tile side in pixels, and
# this fraction of a tile overlaps the next one (`tile_overlap_factor`).
DEFAULT_SAMPLE_SIZE = 32
TILE_OVERLAP = 0.25
# A tiled pass also holds its blended tiles (the row above and the current row, whole), the
# output (its rows and their concatenation, and the clamp's copy when decoding) and, encoding,
# the whole image mapped to [-1, 1] (the cast and the mapped copy).
KEPT_TILE_ROWS = 2
TILED_OUTPUT_COPIES = 3
TILED_INPUT_COPIES = 2


# Config keys fixed to what the network builds (engine/config_keys.py), and those that change
# nothing it computes.
FIXED = {
    "down_block_types": all_of("DownEncoderBlock2D"),
    "up_block_types": all_of("UpDecoderBlock2D"),
    "act_fn": "silu",
    "mid_block_add_attention": True,
}
NOT_READ = {
    "latents_mean": "its pipelines normalise with scaling_factor and shift_factor",
    "latents_std": "its pipelines normalise with scaling_factor and shift_factor",
    "force_upcast": "the dtype a pipeline runs it in: the model entry's encoder_vae_dtype here",
}


class Conv3x3(nn.Conv2d):
    """A 3x3 convolution, stride 1, padding 1 (an `nn.Conv2d`, its weights by the same names).
    On the CPU backend it runs as nine matmuls of shifted views, each accumulated and
    evaluated before the next: MLX's CPU convolution unfolds its input nine times (and copies
    it), about 11 inputs at its peak, where the taps hold about 4 (padded input, one shifted
    copy, one product, the sum)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__(in_dim, out_dim, 3, padding=1)

    def __call__(self, x: mx.array) -> mx.array:
        if mx.default_device() != mx.cpu:
            return super().__call__(x)
        _, height, width, _ = x.shape
        padded = mx.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)])
        out = None
        for dy in range(3):
            for dx in range(3):
                tap = padded[:, dy : dy + height, dx : dx + width, :] @ self.weight[:, dy, dx].T
                out = tap if out is None else out + tap
                mx.eval(out)  # one tap's temporaries at a time
        return out + self.bias


def _silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def _group_norm(groups: int, dims: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, dims, eps=NORM_EPS, affine=True, pytorch_compatible=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, groups: int):
        super().__init__()
        self.norm1 = _group_norm(groups, in_dim)
        self.conv1 = Conv3x3(in_dim, out_dim)
        self.norm2 = _group_norm(groups, out_dim)
        self.conv2 = Conv3x3(out_dim, out_dim)
        self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def __call__(self, x: mx.array) -> mx.array:
        h = self.conv1(_silu(self.norm1(x)))
        h = self.conv2(_silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class AttentionBlock(nn.Module):
    """One-head self-attention over all positions, with its group norm and residual."""

    def __init__(self, dim: int, groups: int):
        super().__init__()
        self.group_norm = _group_norm(groups, dim)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = [nn.Linear(dim, dim)]

    def __call__(self, x: mx.array) -> mx.array:
        batch, height, width, dim = x.shape
        h = self.group_norm(x).reshape(batch, 1, height * width, dim)
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        attended = chunked_attention(q, k, v, dim**-0.5, causal=False)
        return x + self.to_out[0](attended).reshape(x.shape)


class MidBlock(nn.Module):
    def __init__(self, dim: int, groups: int):
        super().__init__()
        self.resnets = [ResnetBlock(dim, dim, groups), ResnetBlock(dim, dim, groups)]
        self.attentions = [AttentionBlock(dim, groups)]

    def __call__(self, x: mx.array) -> mx.array:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class Downsampler(nn.Module):
    """A stride-2 3x3 convolution over the input padded by one on the right and bottom."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, stride=2, padding=0)

    def __call__(self, x: mx.array) -> mx.array:
        return self.conv(mx.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)]))


class Upsampler(nn.Module):
    """Nearest-neighbour doubling, then a 3x3 convolution."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv = Conv3x3(dim, dim)

    def __call__(self, x: mx.array) -> mx.array:
        batch, height, width, dim = x.shape
        doubled = mx.broadcast_to(x[:, :, None, :, None, :], (batch, height, 2, width, 2, dim))
        return self.conv(doubled.reshape(batch, height * 2, width * 2, dim))


class Block(nn.Module):
    """A down block (resnets, then a downsampler) or an up block (resnets, then an upsampler)."""

    def __init__(self, in_dim: int, out_dim: int, resnets: int, groups: int, resample: str):
        super().__init__()
        dims = [in_dim] + [out_dim] * resnets
        self.resnets = [ResnetBlock(a, b, groups) for a, b in zip(dims, dims[1:], strict=False)]
        if resample == "down":
            self.downsamplers = [Downsampler(out_dim)]
        elif resample == "up":
            self.upsamplers = [Upsampler(out_dim)]

    def __call__(self, x: mx.array) -> mx.array:
        for resnet in self.resnets:
            x = resnet(x)
        for resampler in getattr(self, "downsamplers", []) + getattr(self, "upsamplers", []):
            x = resampler(x)
        return x


class Encoder(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        dims, groups = list(config["block_out_channels"]), config["norm_num_groups"]
        last = len(dims) - 1
        self.conv_in = Conv3x3(config["in_channels"], dims[0])
        self.down_blocks = [
            Block(
                dims[max(i - 1, 0)],
                dims[i],
                config["layers_per_block"],
                groups,
                "down" if i < last else "",
            )
            for i in range(len(dims))
        ]
        self.mid_block = MidBlock(dims[-1], groups)
        self.conv_norm_out = _group_norm(groups, dims[-1])
        self.conv_out = Conv3x3(dims[-1], 2 * config["latent_channels"])

    def __call__(self, x: mx.array) -> mx.array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(_silu(self.conv_norm_out(self.mid_block(x))))


def decoder_channels(config: dict) -> list[int]:
    """The decoder's block widths: `decoder_block_out_channels` where the config names its own
    (AutoencoderKLFlux2 may), else the encoder's."""
    return list(config.get("decoder_block_out_channels") or config["block_out_channels"])


class Decoder(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        dims, groups = decoder_channels(config)[::-1], config["norm_num_groups"]
        last = len(dims) - 1
        self.conv_in = Conv3x3(config["latent_channels"], dims[0])
        self.mid_block = MidBlock(dims[0], groups)
        self.up_blocks = [
            Block(
                dims[max(i - 1, 0)],
                dims[i],
                config["layers_per_block"] + 1,
                groups,
                "up" if i < last else "",
            )
            for i in range(len(dims))
        ]
        self.conv_norm_out = _group_norm(groups, dims[-1])
        self.conv_out = Conv3x3(dims[-1], config["out_channels"])

    def __call__(self, z: mx.array) -> mx.array:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(_silu(self.conv_norm_out(x)))


class _Autoencoder(nn.Module):
    """The weight tree, named as in the checkpoint."""

    def __init__(self, config: dict):
        super().__init__()
        latent = config["latent_channels"]
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        if config.get("use_quant_conv", True):
            self.quant_conv = nn.Conv2d(2 * latent, 2 * latent, 1)
        if config.get("use_post_quant_conv", True):
            self.post_quant_conv = nn.Conv2d(latent, latent, 1)


@dataclass(frozen=True)
class Tiling:
    """diffusers' tile geometry of one direction of a pass: tiles of `tile` input positions
    start every `step`, and each output tile, `blend` positions of which are blended into its
    upper and left neighbours, keeps its first `keep` rows and columns."""

    tile: int
    step: int
    blend: int
    keep: int

    @classmethod
    def of(cls, tile_in: int, tile_out: int) -> Tiling:
        blend = int(tile_out * TILE_OVERLAP)
        return cls(tile_in, int(tile_in * (1 - TILE_OVERLAP)), blend, tile_out - blend)

    def starts(self, size: int) -> range:
        return range(0, size, self.step)


def _blend_weights(extent: int) -> tuple[mx.array, mx.array]:
    """The neighbour's and the tile's weights across an overlap of `extent` positions."""
    ramp = np.arange(extent) / extent
    return mx.array((1 - ramp).astype(np.float32)), mx.array(ramp.astype(np.float32))


def _blend(previous: mx.array, tile: mx.array, extent: int, axis: int) -> mx.array:
    """diffusers' blend_v (axis 1) and blend_h (axis 2) in NHWC: the first `extent` rows (or
    columns) of `tile` fade in from the last ones of `previous`."""
    extent = min(previous.shape[axis], tile.shape[axis], extent)
    if extent == 0:
        return tile
    before, after = _blend_weights(extent)
    shape = [1, 1, 1, 1]
    shape[axis] = extent
    before, after = before.reshape(shape), after.reshape(shape)
    size = previous.shape[axis]
    head = mx.take(previous, mx.arange(size - extent, size), axis=axis) * before
    head = head + mx.take(tile, mx.arange(extent), axis=axis) * after
    rest = mx.take(tile, mx.arange(extent, tile.shape[axis]), axis=axis)
    return mx.concatenate([head.astype(tile.dtype), rest], axis=axis)


def run_tiled(x: mx.array, run, tiling: Tiling) -> mx.array:
    """`run` over x (1, H, W, C) tile by tile as diffusers' tiled passes do: each tile blended
    into the already blended tile above it and to its left, then cut to `keep`. Tiles are
    evaluated one at a time; only the row above and the current row are kept whole."""
    above: list[mx.array] = []
    rows = []
    for top in tiling.starts(x.shape[1]):
        row: list[mx.array] = []
        for left in tiling.starts(x.shape[2]):
            tile = run(x[:, top : top + tiling.tile, left : left + tiling.tile])
            if above:
                tile = _blend(above[len(row)], tile, tiling.blend, axis=1)
            if row:
                tile = _blend(row[-1], tile, tiling.blend, axis=2)
            mx.eval(tile)
            row.append(tile)
        kept = [tile[:, : tiling.keep, : tiling.keep] for tile in row]
        rows.append(mx.concatenate(kept, axis=2) if len(kept) > 1 else kept[0])
        mx.eval(rows[-1])
        above = row
    return mx.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]


@dataclass(frozen=True)
class Geometry:
    """What the tiler and the memory plan read from a config, without the networks: the
    stride, diffusers' tile sides (sample_size pixels, int(sample_size / stride) latent cells),
    the channels, and the widest full-resolution activation of each side (the encoder's first
    block, the decoder's last upsampler: the second-to-last up block). `tiles` false: a VAE
    that never tiles (FLUX.2's), every image run whole."""

    stride: int
    tile_pixels: int
    tile_cells: int
    in_channels: int
    out_channels: int
    latent_channels: int
    encode_width: int
    decode_width: int
    tiles: bool = True

    @classmethod
    def of(cls, config: dict, tiles: bool = True) -> Geometry:
        dims = list(config["block_out_channels"])
        decoder = decoder_channels(config)
        stride = 2 ** (len(dims) - 1)
        sample = config.get("sample_size") or DEFAULT_SAMPLE_SIZE
        tile_pixels = int(sample[0] if isinstance(sample, (list, tuple)) else sample)
        return cls(
            stride=stride,
            tile_pixels=tile_pixels,
            tile_cells=int(tile_pixels / stride),
            in_channels=int(config["in_channels"]),
            out_channels=int(config["out_channels"]),
            latent_channels=int(config["latent_channels"]),
            encode_width=dims[0],
            decode_width=decoder[min(1, len(decoder) - 1)],
            tiles=tiles,
        )

    def tileable(self, height: int, width: int, decode: bool) -> bool:
        """Whether a pass of a height x width image can run in tiles: diffusers' rule, on the
        latent size when decoding and on the image when encoding (never for a VAE that does not
        tile)."""
        if not self.tiles:
            return False
        if decode:
            return max(self._cells(height, width)) > self.tile_cells
        return max(height, width) > self.tile_pixels

    def tiling(self, decode: bool) -> Tiling:
        if decode:
            return Tiling.of(self.tile_cells, self.tile_pixels)
        return Tiling.of(self.tile_pixels, self.tile_cells)

    def peak_bytes(
        self, itemsize: int, height: int, width: int, decode: bool, tiled: bool = False
    ) -> int:
        """Bytes one pass of a height x width image may hold at its peak beyond the weights,
        activations of `itemsize` bytes: buffers of the widest full-resolution activation over
        the image, or (`tiled`, where the image can tile) over one tile plus the blended tiles
        and output a tiled pass holds."""
        cells = self._cells(height, width)
        tiled = tiled and self.tileable(height, width, decode)
        window = [min(n, self.tile_cells) for n in cells] if tiled else list(cells)
        pixels = window[0] * window[1] * self.stride**2
        if decode:
            peak = DECODE_BUFFERS * pixels * self.decode_width * itemsize
        else:
            peak = ENCODE_BUFFERS * pixels * self.encode_width * itemsize
        return peak + (self._tiled_held_bytes(cells, decode) if tiled else 0)

    def _cells(self, height: int, width: int) -> tuple[int, int]:
        return math.ceil(height / self.stride), math.ceil(width / self.stride)

    def _tiled_held_bytes(self, cells: tuple[int, int], decode: bool) -> int:
        """The blended tiles (KEPT_TILE_ROWS rows of whole tiles), the output's copies and,
        encoding, the input's, in float32."""
        pixels = cells[0] * cells[1] * self.stride**2
        if decode:
            tiles_per_row = len(self.tiling(decode).starts(cells[1]))
            tile = self.tile_pixels**2 * self.out_channels
            held = TILED_OUTPUT_COPIES * pixels * self.out_channels
        else:
            tiles_per_row = len(self.tiling(decode).starts(cells[1] * self.stride))
            tile = self.tile_cells**2 * self.latent_channels
            held = TILED_OUTPUT_COPIES * cells[0] * cells[1] * self.latent_channels
            held += TILED_INPUT_COPIES * pixels * self.in_channels
        return (KEPT_TILE_ROWS * tiles_per_row * tile + held) * 4


def _mlx_weights(weights: dict[str, mx.array]) -> list[tuple[str, mx.array]]:
    """Checkpoint tensors (diffusers' names, or the ldm names of BFL's and ComfyUI's single
    files: ldm_names) -> MLX parameters: convolution kernels OIHW -> OHWI."""
    return [
        (name, value.transpose(0, 2, 3, 1) if value.ndim == 4 else value)
        for name, value in ldm_names.renamed(weights).items()
    ]


class AutoencoderKL(CheckpointVAE):
    """Encode images to raw latents (the posterior's mean) and decode raw latents to images."""

    def __init__(self, config: dict, dtype: mx.Dtype = mx.float32, tiles: bool = True):
        """`tiles`: a pass asked to tile tiles images past the config's sample_size as
        diffusers' enable_tiling() does (`Geometry`); false: every image runs whole."""
        check_fixed(config, FIXED, "the AutoencoderKL")
        self.config = config
        self.dtype = dtype
        self.latent_channels = int(config["latent_channels"])
        self.in_channels = int(config["in_channels"])
        self.out_channels = int(config["out_channels"])
        self.geometry = Geometry.of(config, tiles)
        self.stride = self.geometry.stride
        self.scaling_factor = float(config.get("scaling_factor", 1.0))
        self.shift_factor = float(config.get("shift_factor") or 0.0)
        self.model = _Autoencoder(config)
        self.weight_bytes = 0

    mlx_weights = staticmethod(_mlx_weights)

    # Latent normalisation: the DiT works on (z - shift_factor) * scaling_factor.

    def to_model_space(self, latents: mx.array) -> mx.array:
        return (latents - self.shift_factor) * self.scaling_factor

    def from_model_space(self, latents: mx.array) -> mx.array:
        return latents / self.scaling_factor + self.shift_factor

    # Passes.

    def tileable(self, height: int, width: int, decode: bool) -> bool:
        """Whether a pass of a height x width image can run in tiles (`Geometry.tileable`)."""
        return self.geometry.tileable(height, width, decode)

    def encode(self, image: mx.array, tiled: bool = False) -> mx.array:
        """(B, H, W, C) in [0, 1], H and W multiples of the stride -> (B, latent, H/s, W/s);
        in tiles where `tiled` and the image can tile."""
        if image.ndim != 4:
            raise EngineInputError(f"an image batch is (B, H, W, C); got shape {image.shape}")
        _, height, width, channels = image.shape
        if channels < self.in_channels:
            raise EngineInputError(
                f"the VAE reads {self.in_channels} image channels; got {channels}"
            )
        if height % self.stride or width % self.stride or height == 0 or width == 0:
            raise EngineInputError(
                f"image size {width}x{height} is not a multiple of the VAE stride {self.stride}"
            )
        latents = [
            self._encode_one(image[i : i + 1, ..., : self.in_channels], tiled)
            for i in range(len(image))
        ]
        return mx.concatenate(latents, axis=0) if len(latents) > 1 else latents[0]

    def decode(self, latents: mx.array, tiled: bool = False) -> mx.array:
        """(B, latent, h, w) raw latents -> (B, s*h, s*w, out_channels) in [0, 1], float32; in
        tiles where `tiled` and the image can tile."""
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels or 0 in latents.shape:
            raise EngineInputError(
                f"latents are (B, {self.latent_channels}, h, w) for this VAE; got shape"
                f" {latents.shape}"
            )
        images = [self._decode_one(latents[i : i + 1], tiled) for i in range(latents.shape[0])]
        return mx.concatenate(images, axis=0) if len(images) > 1 else images[0]

    def peak_bytes(self, height: int, width: int, decode: bool, tiled: bool = False) -> int:
        """The memory plan of one image of height x width pixels (`Geometry.peak_bytes`)."""
        return self.geometry.peak_bytes(self.dtype.size, height, width, decode, tiled)

    def _encode_one(self, image: mx.array, tiled: bool) -> mx.array:
        x = (image.astype(self.dtype) * 2.0) - 1.0  # diffusers' image processor: [0, 1] -> [-1, 1]
        _, height, width, _ = x.shape
        if tiled and self.geometry.tileable(height, width, decode=False):
            mean = run_tiled(x, self._encode_mean, self.geometry.tiling(decode=False))
        else:
            mean = self._encode_mean(x)
        out = mean.transpose(0, 3, 1, 2).astype(mx.float32)
        mx.eval(out)
        return out

    def _encode_mean(self, x: mx.array) -> mx.array:
        """(1, H, W, C) in [-1, 1] -> the posterior's mean (1, H/s, W/s, latent)."""
        moments = self.model.encoder(x)
        if "quant_conv" in self.model:
            moments = self.model.quant_conv(moments)
        return moments[..., : self.latent_channels]  # the log-variance is unused

    def _decode_one(self, latents: mx.array, tiled: bool) -> mx.array:
        z = latents.transpose(0, 2, 3, 1).astype(self.dtype)
        _, cells_h, cells_w, _ = z.shape
        if tiled and self.geometry.tileable(cells_h * self.stride, cells_w * self.stride, True):
            x = run_tiled(z, self._decode_raw, self.geometry.tiling(decode=True))
        else:
            x = self._decode_raw(z)
        # diffusers' image processor maps x / 2 + 0.5 and clamps to [0, 1].
        image = mx.clip(x.astype(mx.float32) / 2 + 0.5, 0.0, 1.0)
        mx.eval(image)
        return image

    def _decode_raw(self, z: mx.array) -> mx.array:
        """(1, h, w, latent) raw latents -> the decoder's output (1, s*h, s*w, C), unclamped."""
        if "post_quant_conv" in self.model:
            z = self.model.post_quant_conv(z)
        return self.model.decoder(z)


def latent_normalisation(config: dict) -> tuple[list[float], list[float]]:
    """The model-space normalisation as per-channel (mean, std), (z - mean) / std: the mean is
    shift_factor and the std 1 / scaling_factor, in every channel."""
    channels = int(config["latent_channels"])
    scale = float(config.get("scaling_factor", 1.0))
    shift = float(config.get("shift_factor") or 0.0)
    return [shift] * channels, [1.0 / scale] * channels


@dataclass(frozen=True)
class AutoencoderKLPart:
    """This VAE as a family's (family.FolderFamily's `vae`): what the status says of it, its
    bytes as it would load, and the peak of a pass at the reference size, from its config.
    Model space is (z - shift_factor) * scaling_factor."""

    tiles: bool = True  # whether a pass may tile large images (the memory plan's fallback)

    def load(self, vae_dir: Path, dtype: mx.Dtype) -> AutoencoderKL:
        """The VAE's network from its folder, computing in `dtype`."""
        return AutoencoderKL.load(vae_dir, dtype)

    def latent(self, config: dict) -> dict | None:
        return None  # the DiT's channels at the family's strides

    @staticmethod
    def channels_out(config: dict) -> int:
        """The image channels a decode gives (status `vae.channels_out`)."""
        return int(config["out_channels"])

    def status_row(self, config: dict) -> dict:
        """Extension of docs/contract.md §2.3 (as Qwen-Image 2.1 publishes it): model space is
        (z - latents_mean) / latents_std, here (z - shift_factor) * scaling_factor."""
        mean, std = latent_normalisation(config)
        return {"latents_mean": mean, "latents_std": std}

    def estimate(self, vae_dir: Path, dtype: mx.Dtype) -> int:
        return estimated_bytes(vae_dir, dtype)

    def reserve_bytes(self, config: dict, pixels: int) -> int:
        """The larger of an encode and a decode of a `pixels` square image in float32, whole."""
        geometry = Geometry.of(config, self.tiles)
        return max(geometry.peak_bytes(4, pixels, pixels, decode) for decode in (True, False))
