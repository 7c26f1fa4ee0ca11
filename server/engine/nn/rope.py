"""Rotary position embeddings, in the two layouts the families use.

- Interleaved pairs over several position axes (the DiTs: Qwen-Image 2.1, Z-Image, FLUX):
  `rope_tables` for positions (N, axes) and per-axis widths, `apply_rope` rotating (x[2i],
  x[2i+1]).
- Rotate-half (transformers' Qwen3 and Qwen3-VL): `inverse_frequencies`, `cos_sin` of
  precomputed angles, `apply_rotary`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

ROPE_THETA = 10000.0


def rope_angles(
    positions: np.ndarray,
    axes_dims: tuple[int, ...],
    theta: float = ROPE_THETA,
    float64: bool = False,
) -> np.ndarray:
    """Angles (N, head_dim/2) float32: each axis's positions times its inverse frequencies,
    computed in float32 (Qwen-Image 2.1's tables) or, with `float64`, in float64 and rounded
    once (Z-Image's, whose reference precomputes its tables in double precision)."""
    dtype = np.float64 if float64 else np.float32
    parts = []
    for axis, dim in enumerate(axes_dims):
        exponent = np.arange(0, dim, 2, dtype=dtype) / dtype(dim)
        inv_freq = (1.0 / np.power(dtype(theta), exponent)).astype(dtype)
        parts.append(positions[:, axis : axis + 1].astype(dtype) * inv_freq[None, :])
    return np.concatenate(parts, axis=1).astype(np.float32)


def rope_tables(
    positions: np.ndarray,
    axes_dims: tuple[int, ...],
    theta: float = ROPE_THETA,
    float64: bool = False,
) -> tuple[mx.array, mx.array]:
    """cos and sin tables (N, 1, head_dim/2) float32, to broadcast over heads."""
    angles = mx.array(rope_angles(positions, axes_dims, theta, float64))[:, None, :]
    return mx.cos(angles), mx.sin(angles)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x (..., N, H, D) as complex numbers, in f32."""
    pairs = x.astype(mx.float32).reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    out = mx.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def inverse_frequencies(theta: float, dim: int) -> np.ndarray:
    """1 / theta^(2i/dim) in float32, computed the way transformers does."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (1.0 / np.power(np.float32(theta), exponents)).astype(np.float32)


def cos_sin(angles: np.ndarray, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """cos and sin of float32 angles, the half repeated to the full rotary width."""
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    return (
        mx.array(np.cos(angles).astype(np.float32)).astype(dtype),
        mx.array(np.sin(angles).astype(np.float32)).astype(dtype),
    )


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    return x * cos + rotate_half(x) * sin
