"""The qwen_image21 size-dependent schedule (docs/contract.md §5.3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from gmlx_contract.schedules import qwen_image21_rule
from gmlx_server.engine import schedules

RULE = qwen_image21_rule()


def by_hand(steps: int, tokens: int) -> list[float]:
    """The rule of docs/contract.md §5.3 written out in plain double precision."""
    m = (0.9 - 0.5) / (8192 - 256)
    mu = tokens * m + (0.5 - m * 256)
    out = []
    for i in range(steps):
        base = 1.0 + i * (1.0 / steps - 1.0) / (steps - 1)
        out.append(math.exp(mu) / (math.exp(mu) + (1.0 / base - 1.0)))
    k = (1.0 - out[-1]) / (1.0 - 0.02)
    return [1.0 - (1.0 - s) / k for s in out] + [0.0]


@pytest.mark.parametrize("steps,tokens", [(40, 4096), (2, 256), (9, 1000), (50, 16384)])
def test_matches_a_hand_computation(steps, tokens):
    got = schedules.sigmas(RULE, steps, tokens)
    assert got.dtype == np.float32 and got.shape == (steps + 1,)
    np.testing.assert_allclose(got, by_hand(steps, tokens), rtol=0, atol=2e-6)
    assert got[-1] == 0.0
    assert abs(got[-2] - 0.02) < 1e-6  # the terminal stretch lands the last sigma on 0.02


@pytest.mark.parametrize("steps,tokens", [(40, 4096), (8, 1024), (20, 256)])
def test_matches_diffusers_scheduler_bit_for_bit(steps, tokens):
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        base_shift=0.5,
        max_shift=0.9,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    m = (0.9 - 0.5) / (8192 - 256)
    mu = tokens * m + (0.5 - m * 256)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    expected = scheduler.sigmas.to(torch.float32).numpy()
    np.testing.assert_array_equal(schedules.sigmas(RULE, steps, tokens), expected)


def test_denoise_keeps_the_tail_of_a_longer_schedule():
    full = schedules.sigmas(RULE, 20, 4096)
    part = schedules.sigmas(RULE, 10, 4096, denoise=0.5)
    np.testing.assert_array_equal(part, full[-11:])


def test_bigger_images_shift_later():
    small = schedules.sigmas(RULE, 10, 256)
    large = schedules.sigmas(RULE, 10, 8192)
    assert np.all(large[1:-2] > small[1:-2])


def test_refusals():
    with pytest.raises(ValueError):
        schedules.sigmas(RULE, 1, 256)
    with pytest.raises(ValueError):
        schedules.sigmas({"rule": "nope"}, 10, 256)
    with pytest.raises(ValueError):
        schedules.sigmas(RULE, 10, 256, denoise=0.0)
