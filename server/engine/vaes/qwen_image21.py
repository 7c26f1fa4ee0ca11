"""Qwen-Image 2.1's VAE (diffusers' `AutoencoderKLQwenImage21`) in MLX, for single images.

The reference is a video VAE (Wan's residual design) specialised to images: its "causal 3D"
convolutions are already 2D convolutions over one frame. Its `is_residual` false is Wan 2.1's
plain layout (no shortcuts around the resamplers, the decoder's upsamplers halving the
channels: `PlainUpBlock`, `plain_down_blocks`), which Qwen-Image's VAE is (vaes/qwen_image.py). What stays temporal reduces, for one
frame, as follows (checked by the parity tests):
- `time_conv` of the 3D resamplers is never applied to a first chunk: the encoder only caches the
  frame, the decoder marks the cache "Rep". Those weights are not loaded.
- The encoder's `AvgDown3D` shortcut with a temporal factor of 2 pads one zero frame in front, so
  half of the values it averages are zeros.
- The decoder's `DupUp3D` shortcut with a temporal factor of 2 keeps only the second temporal copy
  (`first_chunk`), which picks a fixed subset of the repeated channels.

Arrays are channels-last (NHWC) inside; the public methods take and give the layouts of engine/family.py.
Large images are processed in tiles (see `_run_tiled`): everything local runs per tile with a halo
as wide as its receptive field, and the global self-attention of the mid blocks runs once on the
whole latent, so a tiled pass equals the untiled one up to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base import EngineInputError
from ..config_keys import check_fixed
from ..weights import estimated_bytes
from .checkpoint import CheckpointVAE

# F.normalize clamps the L2 norm at 1e-12; the RMS form below adds eps to the mean square.
_NORM_EPS = 1e-24
# Queries per attention call: bounds the (queries x keys) score matrix of the mid blocks.
_ATTENTION_QUERY_CHUNK = 4096
# Tile sides, in latent cells (16 pixels each): at most 64 (a 1024-pixel tile), shrunk until the
# largest activation of a tile, halo included, fits TILE_ACTIVATION_BUDGET. The peak of a pass is
# a small multiple of that activation (on the CPU backend, whose convolutions unfold their input
# 9x, measured about 35x, so about 9 GiB for the full model in float32), so memory stays bounded whatever
# the image size. Smaller tiles cost nothing measurable here (512-px tiles were faster on the CPU).
MAX_TILE_CELLS = 64
MIN_TILE_CELLS = 8
TILE_ACTIVATION_BUDGET = 256 * 2**20


class RMSNorm(nn.Module):
    """`QwenImage21RMS_norm` over the channel axis: x / |x| * sqrt(dim) * gamma (no bias)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = mx.ones((dim,))

    def __call__(self, x: mx.array) -> mx.array:
        # x / sqrt(mean(x^2)) equals x / |x| * sqrt(dim); rms_norm accumulates in float32.
        return mx.fast.rms_norm(x, self.gamma, _NORM_EPS)


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = nn.Conv2d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = nn.Conv2d(out_dim, out_dim, 3, padding=1)
        if in_dim != out_dim:
            self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1)

    def __call__(self, x: mx.array) -> mx.array:
        shortcut = self.conv_shortcut(x) if "conv_shortcut" in self else x
        x = self.conv1(nn.silu(self.norm1(x)))
        x = self.conv2(nn.silu(self.norm2(x)))
        return x + shortcut


class AttentionBlock(nn.Module):
    """Single-head self-attention over all pixels of the (latent-size) image."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def __call__(self, x: mx.array) -> mx.array:
        batch, height, width, dim = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(batch, 1, height * width, 3 * dim)
        q, k, v = mx.split(qkv, 3, axis=-1)
        scale = dim**-0.5
        chunks = [
            mx.fast.scaled_dot_product_attention(
                q[:, :, start : start + _ATTENTION_QUERY_CHUNK], k, v, scale=scale
            )
            for start in range(0, height * width, _ATTENTION_QUERY_CHUNK)
        ]
        out = mx.concatenate(chunks, axis=2) if len(chunks) > 1 else chunks[0]
        return x + self.proj(out.reshape(batch, height, width, dim))


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = [ResidualBlock(dim, dim), ResidualBlock(dim, dim)]
        self.attentions = [AttentionBlock(dim)]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.resnets[0](x)
        return self.resnets[1](self.attentions[0](x))


def _upsample_nearest(x: mx.array) -> mx.array:
    """2x nearest ("nearest-exact" at an integer factor picks the same pixels)."""
    batch, height, width, channels = x.shape
    x = mx.broadcast_to(x[:, :, None, :, None, :], (batch, height, 2, width, 2, channels))
    return x.reshape(batch, height * 2, width * 2, channels)


class Downsampler(nn.Module):
    """`Resample` in a downsample mode: zero-pad right and bottom by one, 3x3 conv at stride 2."""

    def __init__(self, dim: int):
        super().__init__()
        self.resample_conv = nn.Conv2d(dim, dim, 3, stride=2)

    def __call__(self, x: mx.array) -> mx.array:
        return self.resample_conv(mx.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)]))


class Upsampler(nn.Module):
    """`Resample` in an upsample mode: 2x nearest, then a 3x3 conv."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.resample_conv = nn.Conv2d(dim, out_dim, 3, padding=1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.resample_conv(_upsample_nearest(x))


class AvgDownShortcut:
    """`AvgDown3D` on one frame: space-to-depth, then the mean of each group of channels.

    With a temporal factor of 2 the reference pads one zero frame in front of the single frame,
    so the zeros take part in the mean.
    """

    def __init__(self, in_dim: int, out_dim: int, factor_t: int, factor_s: int):
        self.out_dim = out_dim
        self.factor_t = factor_t
        self.factor_s = factor_s
        self.group = in_dim * factor_t * factor_s * factor_s // out_dim

    def __call__(self, x: mx.array) -> mx.array:
        batch, height, width, channels = x.shape
        fs, ft = self.factor_s, self.factor_t
        h, w = height // fs, width // fs
        x = x.reshape(batch, h, fs, w, fs, channels).transpose(0, 1, 3, 5, 2, 4)
        x = x[:, :, :, :, None]  # (b, h, w, c, t, fs, fs), the real frame last in time
        if ft > 1:
            zeros = mx.zeros((batch, h, w, channels, ft - 1, fs, fs), dtype=x.dtype)
            x = mx.concatenate([zeros, x], axis=4)
        x = x.reshape(batch, h, w, self.out_dim, self.group)
        return x.mean(axis=-1)


class DupUpShortcut:
    """`DupUp3D` on a first chunk: repeat channels, depth-to-space, keep the last time copy."""

    def __init__(self, in_dim: int, out_dim: int, factor_t: int):
        self.out_dim = out_dim
        self.factor_t = factor_t
        self.repeats = out_dim * factor_t * 4 // in_dim

    def __call__(self, x: mx.array) -> mx.array:
        batch, height, width, channels = x.shape
        # repeat_interleave over channels, as a broadcast (a copy, cheaper than a gather)
        x = mx.broadcast_to(x[..., None], (batch, height, width, channels, self.repeats))
        x = x.reshape(batch, height, width, self.out_dim, self.factor_t, 2, 2)
        x = x[:, :, :, :, -1]  # the first chunk keeps the last temporal copy only
        x = x.transpose(0, 1, 4, 2, 5, 3)  # (b, h, i, w, j, c)
        return x.reshape(batch, height * 2, width * 2, self.out_dim)


class DownBlock(nn.Module):
    """`QwenImage21ResidualDownBlock`."""

    def __init__(self, in_dim, out_dim, num_res_blocks, temporal: bool, down: bool):
        super().__init__()
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = [ResidualBlock(a, b) for a, b in pairwise(dims)]
        if down:
            self.downsampler = Downsampler(out_dim)
        self._shortcut = AvgDownShortcut(in_dim, out_dim, 2 if temporal else 1, 2 if down else 1)
        self.in_dim, self.out_dim = in_dim, out_dim

    def __call__(self, x: mx.array) -> mx.array:
        shortcut = self._shortcut(x)
        for resnet in self.resnets:
            x = resnet(x)
        if "downsampler" in self:
            x = self.downsampler(x)
        return x + shortcut


class UpBlock(nn.Module):
    """`QwenImage21ResidualUpBlock` on a first chunk."""

    def __init__(self, in_dim, out_dim, num_res_blocks, temporal: bool, up: bool):
        super().__init__()
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = [ResidualBlock(a, b) for a, b in pairwise(dims)]
        if up:
            self.upsampler = Upsampler(out_dim, out_dim)
            self._shortcut = DupUpShortcut(in_dim, out_dim, 2 if temporal else 1)
        self.in_dim, self.out_dim = in_dim, out_dim

    def __call__(self, x: mx.array) -> mx.array:
        shortcut = x
        for resnet in self.resnets:
            x = resnet(x)
        if "upsampler" in self:
            x = self.upsampler(x) + self._shortcut(shortcut)
        return x


def residual_blocks(block: type, dims: list[int], num_res_blocks: int, temporal) -> list:
    """The residual stack of an encoder (`DownBlock`) or a decoder (`UpBlock`): block i from
    dims[i] to dims[i + 1], each but the last resampling, in time too where `temporal[i]`
    says."""
    last = len(dims) - 2
    return [
        block(dims[i], dims[i + 1], num_res_blocks, i != last and bool(temporal[i]), i != last)
        for i in range(last + 1)
    ]


class PlainUpBlock(nn.Module):
    """`QwenImage21UpBlock` of the plain layout (is_residual false, Wan 2.1's, as
    `QwenImageUpBlock`): resnets, then an upsampler that halves the channels."""

    def __init__(self, in_dim, out_dim, num_res_blocks, up: bool):
        super().__init__()
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = [ResidualBlock(a, b) for a, b in pairwise(dims)]
        if up:
            self.upsamplers = [Upsampler(out_dim, out_dim // 2)]

    def __call__(self, x: mx.array) -> mx.array:
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if "upsamplers" in self else x


def plain_down_blocks(dims: list[int], num_res_blocks: int) -> list[list[nn.Module]]:
    """The encoder's levels in the plain layout (is_residual false): each level's resnets and,
    but for the last, its downsampler; the checkpoint numbers them as one flat list."""
    last = len(dims) - 2
    levels = []
    for i in range(last + 1):
        level = [
            ResidualBlock(a, b) for a, b in pairwise([dims[i]] + [dims[i + 1]] * num_res_blocks)
        ]
        if i != last:
            level.append(Downsampler(dims[i + 1]))
        levels.append(level)
    return levels


def plain_up_in_dims(dims: list[int]) -> list[int]:
    """Each plain up block's input channels: after the first, half the level's (the upsampler
    before it halved them)."""
    return [dim if i == 0 else dim // 2 for i, dim in enumerate(dims[:-1])]


@dataclass(frozen=True)
class Stage:
    """A local part of a network, as the tiler sees it.

    `reach` is how far, in latent cells, values spoiled at a window's edge (by zero padding where
    the image goes on) can travel inward through this stage; `px_per_cell` is the resolution of the
    stage's output (pixels per latent cell). `cell_values` is the number of values per latent cell
    of its largest activation, for sizing tiles.
    """

    run: Callable[[mx.array], mx.array]
    reach: float
    px_per_cell: int
    cell_values: int = 1


def _block_reach(convs: int, extra_px: int, px_per_cell: int) -> float:
    """Reach of `convs` 3x3 convolutions plus `extra_px` pixels of resampling, in cells."""
    return (convs + extra_px) / px_per_cell


@dataclass(frozen=True)
class StageShapes:
    """The stages of one side of the VAE without their networks (run None): a pure function of
    the config, for the tiler and the memory estimate. `width` is the channels of the global
    part at latent size (the mid block)."""

    stages: tuple[Stage, ...]
    width: int


def encoder_shapes(config: dict) -> StageShapes:
    mults = list(config["dim_mult"])
    dims = [config["base_dim"] * m for m in [1, *mults]]
    last, blocks = len(mults) - 1, config["num_res_blocks"]
    stages, px_per_cell = [], 2**last
    for index in range(len(mults)):
        down = index != last
        # A stride-2 3x3 conv over a right/bottom pad reads two pixels past its own.
        reach = _block_reach(2 * blocks, 2 if down else 0, px_per_cell)
        if index == 0:
            reach += _block_reach(1, 0, px_per_cell)  # conv_in
        # the widest activations are the block's input-size ones
        cell_values = px_per_cell**2 * max(dims[index], dims[index + 1])
        px_per_cell //= 2 if down else 1
        stages.append(Stage(None, reach, px_per_cell, cell_values))
    return StageShapes(tuple(stages), dims[-1])


def decoder_shapes(config: dict) -> StageShapes:
    base = config.get("decoder_base_dim") or config["base_dim"]
    mults = list(config["dim_mult"])
    dims = [base * m for m in [mults[-1], *mults[::-1]]]
    last, blocks = len(mults) - 1, config["num_res_blocks"]
    stages, px_per_cell = [], 1
    for index in range(len(mults)):
        up = index != last
        # The upsampler's conv at twice the size reaches half an input pixel; count a whole one.
        reach = _block_reach(2 * (blocks + 1), 1 if up else 0, px_per_cell)
        # resnets at the input size (in and out channels), the upsampler's out at twice the size
        cell_values = px_per_cell**2 * max(dims[index], dims[index + 1])
        px_per_cell *= 2 if up else 1
        cell_values = max(cell_values, px_per_cell**2 * dims[index + 1])
        if index == last:
            reach += _block_reach(1, 0, px_per_cell)  # conv_out
        stages.append(Stage(None, reach, px_per_cell, cell_values))
    return StageShapes(tuple(stages), dims[0])


class Encoder(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        base, mults = config["base_dim"], list(config["dim_mult"])
        dims = [base * m for m in [1, *mults]]
        last = len(mults) - 1
        self.num_res_blocks = config["num_res_blocks"]
        self.conv_in = nn.Conv2d(config["in_channels"], dims[0], 3, padding=1)
        if config.get("is_residual", True):
            temporal = config["temperal_downsample"]
            blocks = residual_blocks(DownBlock, dims, self.num_res_blocks, temporal)
            self._levels = [[block] for block in blocks]
        else:
            self._levels = plain_down_blocks(dims, self.num_res_blocks)
        self.down_blocks = [module for level in self._levels for module in level]
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], config["z_dim"] * 2, 3, padding=1)
        self.stride = 2**last
        self._shapes = encoder_shapes(config)

    def stages(self) -> list[Stage]:
        """The local part (conv_in and the down blocks), one stage per block."""
        runs = [
            _chain(self.conv_in, *level) if i == 0 else _chain(*level)
            for i, level in enumerate(self._levels)
        ]
        return [
            replace(shape, run=run) for shape, run in zip(self._shapes.stages, runs, strict=True)
        ]

    def tail(self, x: mx.array) -> mx.array:
        """The global part at latent size: mid block (with attention) and the output head."""
        x = self.mid_block(x)
        return self.conv_out(nn.silu(self.norm_out(x)))


class Decoder(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        base = config.get("decoder_base_dim") or config["base_dim"]
        mults = list(config["dim_mult"])
        dims = [base * m for m in [mults[-1], *mults[::-1]]]
        last = len(mults) - 1
        temporal = list(config["temperal_downsample"])[::-1]
        self.num_res_blocks = config["num_res_blocks"]
        self.conv_in = nn.Conv2d(config["z_dim"], dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        if config.get("is_residual", True):
            self.up_blocks = residual_blocks(UpBlock, dims, self.num_res_blocks, temporal)
        else:
            ins = plain_up_in_dims(dims)
            self.up_blocks = [
                PlainUpBlock(ins[i], dims[i + 1], self.num_res_blocks, up=i != last)
                for i in range(len(mults))
            ]
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], config["out_channels"], 3, padding=1)
        self._shapes = decoder_shapes(config)

    def head(self, x: mx.array) -> mx.array:
        """The global part at latent size: conv_in and the mid block (with attention)."""
        return self.mid_block(self.conv_in(x))

    def output(self, x: mx.array) -> mx.array:
        return self.conv_out(nn.silu(self.norm_out(x)))

    def stages(self) -> list[Stage]:
        """The local part (the up blocks and the output head), one stage per block."""
        last = len(self.up_blocks) - 1
        runs = [
            _chain(block, self.output) if i == last else block
            for i, block in enumerate(self.up_blocks)
        ]
        return [
            replace(shape, run=run) for shape, run in zip(self._shapes.stages, runs, strict=True)
        ]


def _chain(*parts: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
    def run(x: mx.array) -> mx.array:
        for part in parts:
            x = part(x)
        return x

    return run


def _spans(cells: int, tile_cells: int) -> list[tuple[int, int]]:
    """Split [0, cells) into the fewest near-equal spans of at most tile_cells."""
    count = max(1, math.ceil(cells / tile_cells))
    bounds = [round(i * cells / count) for i in range(count + 1)]
    return list(pairwise(bounds))


def _run_stages(x: mx.array, stages: list[Stage]) -> mx.array:
    for stage in stages:
        x = stage.run(x)
    return x


def _run_tiled(
    x: mx.array, stages: list[Stage], px_per_cell: int, cells: tuple[int, int], tile_cells: int
) -> mx.array:
    """Run local `stages` over `x` (NHWC, `px_per_cell` pixels per latent cell) tile by tile.

    Each tile is a core of latent cells plus a halo covering the reach of the remaining stages;
    after each stage the halo is cut down to what the later stages still need, so the work
    spent on halos shrinks as the resolution grows. Tiles are evaluated one at a time, which
    bounds memory by the largest tile.
    """
    halos = _halos(stages)
    rows = []
    for core_y in _spans(cells[0], tile_cells):
        row = []
        for core_x in _spans(cells[1], tile_cells):
            tile = _run_tile(x, stages, halos, px_per_cell, (core_y, core_x), cells)
            mx.eval(tile)
            row.append(tile)
        rows.append(mx.concatenate(row, axis=2) if len(row) > 1 else row[0])
    return mx.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]


def _halos(stages: list[Stage]) -> list[int]:
    """Halo, in cells, of the window entering each stage: the reach of it and all later ones."""
    return [math.ceil(sum(stage.reach for stage in stages[k:])) for k in range(len(stages))]


def _largest_tile_bytes(stages: list[Stage], tile_cells: int, itemsize: int) -> int:
    sizes = []
    for stage, halo in zip(stages, _halos(stages), strict=True):
        side = tile_cells + 2 * halo
        sizes.append(side * side * stage.cell_values * itemsize)
    return max(sizes)


def choose_tile_cells(stage_lists: list[list[Stage]], itemsize: int) -> int:
    """The largest tile side whose biggest activation fits TILE_ACTIVATION_BUDGET."""
    for cells in range(MAX_TILE_CELLS, MIN_TILE_CELLS, -1):
        largest = max(_largest_tile_bytes(stages, cells, itemsize) for stages in stage_lists)
        if largest <= TILE_ACTIVATION_BUDGET:
            return cells
    return MIN_TILE_CELLS


# Memory plan of one image's pass (the server refuses work whose plan does not fit). The peak of
# the local part is a multiple of its largest activation (a tile, halo included, or the whole
# image when untiled): on the CPU backend, whose convolutions unfold their input 9x and keep a
# padded copy, measured 35x for the full model and 40x for the tiny test model (tests/memory, up to 41x), so
# LOCAL_PEAK_MULTIPLE, a little above both, is used on every backend as a bound. The global
# part at latent size (the mid block) holds a few activations of its width and the attention
# scores of one query chunk in float32 (q, scores and softmax temporaries).
LOCAL_PEAK_MULTIPLE = 46
MID_BLOCK_BUFFERS = 8
SCORE_BUFFERS = 3
# Full-size images alive at once: the input or output, its float32 copy, the tiles' rows and
# their concatenation, the clamp.
IMAGE_COPIES = 4


def pass_peak_bytes(
    config: dict, itemsize: int, cells: tuple[int, int], decode: bool, tile_cells: int
) -> int:
    """Bytes one image's decode (or encode) may hold at its peak, beyond the weights: a pure
    function of the config, the latent size in cells and the tile side (no allocation)."""
    shapes = decoder_shapes(config) if decode else encoder_shapes(config)
    tiled = max(cells) > tile_cells
    halos = _halos(list(shapes.stages))
    largest = 0
    for stage, halo in zip(shapes.stages, halos, strict=True):
        window = [min(n, tile_cells + 2 * halo) if tiled else n for n in cells]
        largest = max(largest, window[0] * window[1] * stage.cell_values * itemsize)
    tokens = cells[0] * cells[1]
    scores = min(_ATTENTION_QUERY_CHUNK, tokens) * tokens * 4 * SCORE_BUFFERS
    mid = MID_BLOCK_BUFFERS * tokens * shapes.width * itemsize + scores
    stride = 2 ** (len(config["dim_mult"]) - 1)
    channels = max(config["in_channels"], config["out_channels"])
    image = tokens * stride * stride * channels * 4
    return LOCAL_PEAK_MULTIPLE * largest + mid + IMAGE_COPIES * image


def _window(core: tuple[int, int], halo: int, size: int) -> tuple[int, int]:
    return max(0, core[0] - halo), min(size, core[1] + halo)


def _run_tile(x, stages, halos, px_per_cell, cores, cells) -> mx.array:
    windows = [_window(core, halos[0], size) for core, size in zip(cores, cells, strict=True)]
    (y0, y1), (x0, x1) = windows
    tile = x[:, y0 * px_per_cell : y1 * px_per_cell, x0 * px_per_cell : x1 * px_per_cell]
    for index, stage in enumerate(stages):
        tile = stage.run(tile)
        px_per_cell = stage.px_per_cell
        halo = halos[index + 1] if index + 1 < len(stages) else 0
        inner = [_window(core, halo, size) for core, size in zip(cores, cells, strict=True)]
        tile = _crop(tile, windows, inner, px_per_cell)
        windows = inner
    return tile


def _crop(tile: mx.array, outer, inner, px_per_cell: int) -> mx.array:
    """Cut `tile`, which covers the cell window `outer`, down to the window `inner`."""
    (oy, _), (ox, _) = outer
    (iy0, iy1), (ix0, ix1) = inner
    return tile[
        :,
        (iy0 - oy) * px_per_cell : (iy1 - oy) * px_per_cell,
        (ix0 - ox) * px_per_cell : (ix1 - ox) * px_per_cell,
    ]


# Config keys fixed to what the network builds (engine/config_keys.py): no attention beyond
# the mid blocks'; and those that change nothing it computes.
FIXED = {"attn_scales": []}
NOT_READ = {
    "dropout": "inactive at inference",
    "scale_factor_temporal": "its pipelines' fact; the strides come from dim_mult here",
    "scale_factor_spatial": "its pipelines' fact; the strides come from dim_mult here",
}


def _check_config(config: dict) -> None:
    check_fixed(config, FIXED, "the Qwen-Image VAE")
    if config.get("patch_size") not in (None, 1):
        raise ValueError(f"a VAE patch_size of {config['patch_size']} is not supported")
    if len(config["temperal_downsample"]) < len(config["dim_mult"]) - 1:
        raise ValueError("temperal_downsample needs one entry per downsampling")


def checkpoint_weights(weights: dict[str, mx.array]) -> list[tuple[str, mx.array]]:
    """The file's weights under this module's names and layouts, time_conv left out."""
    converted = []
    for name, value in weights.items():
        if ".time_conv." in name:
            continue  # never applied to a single frame (see the module docstring)
        name = name.replace(".resample.1.", ".resample_conv.")
        if name.endswith(".gamma"):  # (dim, 1, 1[, 1]) -> (dim,)
            value = value.reshape(-1)
        elif value.ndim == 4:  # conv (out, in, kh, kw) -> MLX (out, kh, kw, in)
            value = value.transpose(0, 2, 3, 1)
        converted.append((name, value))
    return converted


class _Autoencoder(nn.Module):
    """The weight tree, named as in the checkpoint."""

    def __init__(self, config: dict):
        super().__init__()
        z_dim = config["z_dim"]
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv2d(z_dim * 2, z_dim * 2, 1)
        self.post_quant_conv = nn.Conv2d(z_dim, z_dim, 1)
        self.decoder = Decoder(config)


class QwenImage21VAE(CheckpointVAE):
    """Encode images to raw latents (distribution mean) and decode raw latents to images.

    Images are channels-last in [0, 1]; latents are (B, z_dim, h, w) in the VAE's own space.
    Batches are processed one image at a time.
    """

    def __init__(self, config: dict, dtype: mx.Dtype = mx.float32):
        _check_config(config)
        self.config = config
        self.dtype = dtype
        self.z_dim = int(config["z_dim"])
        self.in_channels = int(config["in_channels"])
        self.out_channels = int(config["out_channels"])
        self.stride = 2 ** (len(config["dim_mult"]) - 1)
        self.latents_mean = np.asarray(config["latents_mean"], dtype=np.float32)
        self.latents_std = np.asarray(config["latents_std"], dtype=np.float32)
        if self.latents_mean.shape != (self.z_dim,) or self.latents_std.shape != (self.z_dim,):
            raise ValueError("latents_mean and latents_std need one value per latent channel")
        self.model = _Autoencoder(config)
        stage_lists = [self.model.encoder.stages(), self.model.decoder.stages()]
        self.tile_cells = choose_tile_cells(stage_lists, dtype.size)
        self.weight_bytes = 0

    mlx_weights = staticmethod(checkpoint_weights)

    # Latent normalisation of the family: the DiT works on (raw - mean) / std.

    def to_model_space(self, latents: mx.array) -> mx.array:
        mean, std = self._stats(latents.dtype)
        return (latents - mean) / std

    def from_model_space(self, latents: mx.array) -> mx.array:
        mean, std = self._stats(latents.dtype)
        return latents * std + mean

    def _stats(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        shape = (1, self.z_dim, 1, 1)
        mean = mx.array(self.latents_mean).reshape(shape).astype(dtype)
        return mean, mx.array(self.latents_std).reshape(shape).astype(dtype)

    # Passes.

    def tileable(self, height: int, width: int, decode: bool) -> bool:
        """Never on request: its tiles are exact, so a pass tiles by size on its own."""
        return False

    def encode(self, image: mx.array, tiled: bool = False) -> mx.array:
        """(B, H, W, C) in [0, 1], H and W multiples of the stride -> (B, z_dim, H/16, W/16)
        (`tiled` has nothing to ask: `tileable`)."""
        if image.ndim != 4:
            raise EngineInputError(f"an image batch is (B, H, W, C); got shape {image.shape}")
        image = self._input_channels(image)
        _, height, width, _ = image.shape
        if height % self.stride or width % self.stride or height == 0 or width == 0:
            raise EngineInputError(
                f"image size {width}x{height} is not a multiple of the VAE stride {self.stride}"
            )
        latents = [self._encode_one(image[i : i + 1]) for i in range(image.shape[0])]
        return mx.concatenate(latents, axis=0) if len(latents) > 1 else latents[0]

    def decode(self, latents: mx.array, tiled: bool = False) -> mx.array:
        """(B, z_dim, h, w) raw latents -> (B, 16h, 16w, out_channels) in [0, 1], float32."""
        if latents.ndim != 4 or latents.shape[1] != self.z_dim:
            raise EngineInputError(
                f"latents are (B, {self.z_dim}, h, w) for this VAE; got shape {latents.shape}"
            )
        images = [self._decode_one(latents[i : i + 1]) for i in range(latents.shape[0])]
        return mx.concatenate(images, axis=0) if len(images) > 1 else images[0]

    def peak_bytes(self, height: int, width: int, decode: bool, tiled: bool = False) -> int:
        """The memory plan of one image of height x width pixels (see `pass_peak_bytes`)."""
        cells = (math.ceil(height / self.stride), math.ceil(width / self.stride))
        return pass_peak_bytes(self.config, self.dtype.size, cells, decode, self.tile_cells)

    def _input_channels(self, image: mx.array) -> mx.array:
        """Drop channels the VAE does not read; give an RGB image an opaque alpha."""
        channels = image.shape[-1]
        if channels >= self.in_channels:
            return image[..., : self.in_channels]
        if channels == 3 and self.in_channels == 4:
            alpha = mx.ones((*image.shape[:-1], 1), dtype=image.dtype)
            return mx.concatenate([image, alpha], axis=-1)
        raise EngineInputError(f"the VAE reads {self.in_channels} image channels; got {channels}")

    def _encode_one(self, image: mx.array) -> mx.array:
        encoder = self.model.encoder
        x = (image.astype(self.dtype) * 2.0) - 1.0  # diffusers' image processor: [0, 1] -> [-1, 1]
        cells = (image.shape[1] // self.stride, image.shape[2] // self.stride)
        x = self._run_local(x, encoder.stages(), self.stride, cells)
        moments = self.model.quant_conv(encoder.tail(x))
        mean = moments[..., : self.z_dim]  # the distribution's mode; the log-variance is unused
        out = mean.transpose(0, 3, 1, 2).astype(mx.float32)
        mx.eval(out)
        return out

    def _decode_one(self, latents: mx.array) -> mx.array:
        decoder = self.model.decoder
        z = latents.transpose(0, 2, 3, 1).astype(self.dtype)
        x = decoder.head(self.model.post_quant_conv(z))
        x = self._run_local(x, decoder.stages(), 1, (z.shape[1], z.shape[2]))
        # diffusers clamps to [-1, 1]; its image processor maps x / 2 + 0.5 and clamps to [0, 1].
        image = mx.clip(mx.clip(x.astype(mx.float32), -1.0, 1.0) / 2 + 0.5, 0.0, 1.0)
        mx.eval(image)
        return image

    def _run_local(self, x, stages, px_per_cell, cells) -> mx.array:
        if max(cells) <= self.tile_cells:
            return _run_stages(x, stages)
        mx.eval(x)  # the global part first, so each tile graph stands alone
        return _run_tiled(x, stages, px_per_cell, cells, self.tile_cells)


class QwenImage21VAEPart:
    """This VAE as a family's (family.FolderFamily's `vae`): what the status says of it, its
    bytes as it would load, and the peak of a pass at the reference size, from its config."""

    def load(self, vae_dir: Path, dtype: mx.Dtype) -> QwenImage21VAE:
        """The VAE's network from its folder, computing in `dtype`."""
        return QwenImage21VAE.load(vae_dir, dtype)

    @staticmethod
    def latent(config: dict) -> dict | None:
        return None  # the DiT's channels at the family's strides

    @staticmethod
    def channels_out(config: dict) -> int:
        """The image channels a decode gives (status `vae.channels_out`)."""
        return int(config["out_channels"])

    @staticmethod
    def status_row(config: dict) -> dict:
        """Extension of docs/contract.md §2.3: the normalisation from the VAE routes' latent
        space to the DiT's model space, (z - mean) / std, which a client such as the ComfyUI
        pack needs to move ComfyUI's LATENT into the step's space."""
        return {
            "latents_mean": [float(v) for v in config["latents_mean"]],
            "latents_std": [float(v) for v in config["latents_std"]],
        }

    @staticmethod
    def estimate(vae_dir: Path, dtype: mx.Dtype) -> int:
        return estimated_bytes(vae_dir, dtype)

    @staticmethod
    def reserve_bytes(config: dict, pixels: int) -> int:
        """The larger of an encode and a decode of a `pixels` square image in float32, tiled
        as a pass of that size tiles."""
        cells = pixels // (2 ** (len(config["dim_mult"]) - 1))
        shapes = [list(encoder_shapes(config).stages), list(decoder_shapes(config).stages)]
        tile = choose_tile_cells(shapes, 4)
        return max(pass_peak_bytes(config, 4, (cells, cells), d, tile) for d in (True, False))
