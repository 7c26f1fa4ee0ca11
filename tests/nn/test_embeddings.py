"""The timestep embedding's frequencies against diffusers' (`get_timestep_embedding`, torch's
float32 exp): the correctly rounded exponentials, equal to torch's nearly everywhere and never
more than one ulp from them, where numpy's float32 exp misses 54 of the 128 of a 256-wide
embedding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gmlx_server.engine.nn.embeddings import time_frequencies


def diffusers_frequencies(dim: int) -> np.ndarray:
    """The frequencies get_timestep_embedding uses (flip_sin_to_cos, downscale_freq_shift 0)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(0, half, dtype=torch.float32)
    return torch.exp(exponent / half).numpy()


@pytest.mark.parametrize("dim", [32, 256])
def test_the_frequencies_are_the_references_within_an_ulp(dim):
    ours = np.array(time_frequencies(dim))
    theirs = diffusers_frequencies(dim)
    ulps = np.abs(ours.view(np.int32) - theirs.view(np.int32))
    assert ulps.max() <= 1
    assert (ulps == 0).mean() >= 0.97, f"{(ulps != 0).sum()} of {ulps.size} differ"
