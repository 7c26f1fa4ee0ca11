"""Embeddings every DiT shares."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

# diffusers' `Timesteps` default period, which every family's time projection uses.
TIME_MAX_PERIOD = 10000.0


def time_frequencies(dim: int, max_period: float = TIME_MAX_PERIOD) -> mx.array:
    """The sinusoidal timestep embedding's frequencies exp(-log(max_period) * i / half), i <
    half = dim / 2: the exponents in float32 as diffusers' `get_timestep_embedding` computes
    them, their exponential correctly rounded to float32 (taken in float64), which torch's
    float32 exp gives for all but 3 of the 128 frequencies of a 256-wide embedding on x86 (numpy's
    float32 exp for 74: tests/nn/test_embeddings.py)."""
    half = dim // 2
    exponent = (-math.log(max_period) * np.arange(half, dtype=np.float32)).astype(np.float32)
    exponent = (exponent / np.float32(half)).astype(np.float32)
    return mx.array(np.exp(exponent.astype(np.float64)).astype(np.float32))
