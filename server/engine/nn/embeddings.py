"""Embeddings every DiT shares."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

# diffusers' `Timesteps` defaults, which every family's time projection uses.
TIME_PROJ_DIM = 256
TIME_MAX_PERIOD = 10000.0


def time_frequencies(dim: int = TIME_PROJ_DIM, max_period: float = TIME_MAX_PERIOD) -> mx.array:
    """The sinusoidal timestep embedding's frequencies exp(-log(max_period) * i / half), i <
    half = dim / 2, computed in float32 as diffusers' `get_timestep_embedding` computes them."""
    half = dim // 2
    exponent = -math.log(max_period) * np.arange(half, dtype=np.float32) / np.float32(half)
    return mx.array(np.exp(exponent.astype(np.float32)).astype(np.float32))
