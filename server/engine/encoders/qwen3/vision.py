"""Qwen3-VL's vision tower in MLX, by transformers' names: patches of one still image -> merged
rows for the language model and the DeepStack features of some of its blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...nn.activations import hidden_activation
from ...nn.attention import chunked_attention
from ...nn.rope import apply_rotary, cos_sin, inverse_frequencies


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_indexes: tuple[int, ...]
    rope_theta: float
    hidden_act: str

    @classmethod
    def from_dict(cls, config: dict) -> VisionConfig:
        rope = config.get("rope_parameters") or {}
        return cls(
            depth=config["depth"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=config["num_heads"],
            in_channels=config.get("in_channels", 3),
            patch_size=config["patch_size"],
            temporal_patch_size=config.get("temporal_patch_size", 2),
            merge_size=config.get("spatial_merge_size", 2),
            out_hidden_size=config["out_hidden_size"],
            num_position_embeddings=config["num_position_embeddings"],
            deepstack_indexes=tuple(config.get("deepstack_visual_indexes", ())),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            hidden_act=config.get("hidden_act", "gelu_pytorch_tanh"),
        )


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        length = x.shape[0]
        qkv = self.qkv(x).reshape(length, 3, self.num_heads, self.head_dim).transpose(1, 2, 0, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (heads, N, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = chunked_attention(q[None], k[None], v[None], self.head_dim**-0.5, causal=False)
        return self.proj(out[0].transpose(1, 0, 2).reshape(length, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = hidden_activation(config.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 block of patches -> one language-model row. The final merger norms each patch
    before joining them; the DeepStack mergers norm the joined block."""

    def __init__(self, config: VisionConfig, norm_after_join: bool):
        super().__init__()
        self.joined = config.hidden_size * config.merge_size**2
        self.norm_after_join = norm_after_join
        self.norm = nn.LayerNorm(self.joined if norm_after_join else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.joined, self.joined, bias=True)
        self.linear_fc2 = nn.Linear(self.joined, config.out_hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        if self.norm_after_join:
            x = self.norm(x.reshape(-1, self.joined))
        else:
            x = self.norm(x).reshape(-1, self.joined)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The Conv3d whose kernel equals its stride is a linear map of each flattened patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        patch_width = (
            config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size
        )
        self.proj = nn.Linear(patch_width, config.hidden_size, bias=True)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        return self.proj(pixel_values)


@dataclass
class VisionFeatures:
    merged: mx.array  # (rows, out_hidden)
    deepstack: list[mx.array] = field(default_factory=list)  # each (rows, out_hidden)


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = [VisionBlock(config) for _ in range(config.depth)]
        self.merger = PatchMerger(config, norm_after_join=False)
        self.deepstack_merger_list = [
            PatchMerger(config, norm_after_join=True) for _ in config.deepstack_indexes
        ]
        self._grid_side = int(config.num_position_embeddings**0.5)
        head_dim = config.hidden_size // config.num_heads
        self._inv_freq = inverse_frequencies(config.rope_theta, head_dim // 2)

    def patch_coordinates(self, grid_h: int, grid_w: int) -> tuple[np.ndarray, np.ndarray]:
        """Row and column of each patch in the processor's merge-block order."""
        m = self.config.merge_size
        rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
        block = (grid_h // m, m, grid_w // m, m)
        return (
            rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1),
            cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1),
        )

    def position_embedding(self, rows: np.ndarray, cols: np.ndarray, grid_h: int, grid_w: int):
        """The learned square position table resampled bilinearly (align_corners) to the grid."""
        side = self._grid_side

        def taps(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
            src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            floor = np.floor(src)
            raw = floor.astype(np.int64)[:, None] + np.arange(2)
            distance = np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32))
            return raw.clip(0, side - 1), np.clip(1 - distance, 0, None).astype(np.float32)

        h_taps, h_weights = taps(rows, grid_h)
        w_taps, w_weights = taps(cols, grid_w)
        indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        table = self.pos_embed(mx.array(indices))  # (N, 4, hidden); a quantized table too
        return (table * mx.array(weights)[:, :, None].astype(table.dtype)).sum(axis=1)

    def rotary(self, rows: np.ndarray, cols: np.ndarray, dtype: mx.Dtype):
        """2D RoPE: the same frequencies over rows then columns, repeated to the head width."""
        angles = np.concatenate(
            [
                rows.astype(np.float32)[:, None] * self._inv_freq,
                cols.astype(np.float32)[:, None] * self._inv_freq,
            ],
            axis=-1,
        )
        return cos_sin(angles, dtype)

    def __call__(self, pixel_values: mx.array, grid_thw: tuple[int, int, int]) -> VisionFeatures:
        """One image's patches (N, C*T*P*P) -> its merged rows and DeepStack features."""
        grid_t, grid_h, grid_w = grid_thw
        if grid_t != 1:
            raise ValueError("only still images (one temporal patch) are encoded")
        rows, cols = self.patch_coordinates(grid_h, grid_w)
        dtype = self.patch_embed.proj.weight.dtype
        hidden = self.patch_embed(pixel_values.astype(dtype))
        hidden = hidden + self.position_embedding(rows, cols, grid_h, grid_w).astype(dtype)
        cos, sin = self.rotary(rows, cols, dtype)
        deepstack = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin)
            if index in self.config.deepstack_indexes:
                merger = self.deepstack_merger_list[self.config.deepstack_indexes.index(index)]
                deepstack.append(merger(hidden))
        return VisionFeatures(self.merger(hidden), deepstack)
