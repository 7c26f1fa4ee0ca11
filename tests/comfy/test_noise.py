"""server/engine/noise.py against torch's own CPU randn (what ComfyUI's prepare_noise calls)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gmlx_server.engine.noise import comfy_noise, default_kernel, fma

SEEDS = [0, 1, 42, 2**31 + 7, 2**32 + 5, 0xFFFFFFFFFFFFFFFF]
# Under 16 values (double path), exact blocks, tails of every length class, latent shapes.
SHAPES = [
    (1,),
    (3,),
    (2, 7),
    (15,),
    (16,),
    (17,),
    (31,),
    (1, 64, 4, 4),
    (2, 16, 13, 7),
    (1, 3, 5, 7),
    (1, 64, 24, 40),
]


def torch_randn(seed: int, shape: tuple) -> np.ndarray:
    generator = torch.manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu").numpy()


def torch_kernel() -> str:
    """The kernel this torch build runs: the vectorised one unless it runs its DEFAULT code."""
    return "scalar" if torch.backends.cpu.get_cpu_capability() == "DEFAULT" else "vector"


@pytest.mark.parametrize("seed", SEEDS)
def test_equals_torch_randn(seed):
    kernel = torch_kernel()
    for shape in SHAPES:
        want = torch_randn(seed, shape)
        got = comfy_noise(seed, shape, kernel)
        assert got.dtype == np.float32 and got.shape == want.shape
        if kernel == "vector" or want.size < 16:
            np.testing.assert_array_equal(got, want, err_msg=f"seed {seed} shape {shape}")
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=5e-7)


def test_scalar_kernel_against_torch_default_code():
    """Torch forced to its DEFAULT (libm) kernels: the scalar kernel is within an ulp."""
    script = (
        "import json, torch\n"
        "out = {}\n"
        "for seed in (0, 9):\n"
        "    g = torch.manual_seed(seed)\n"
        "    out[seed] = torch.randn((1, 64, 16, 20), generator=g).flatten().tolist()\n"
        "print(json.dumps([torch.backends.cpu.get_cpu_capability(), out]))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    capability, values = json.loads(done.stdout)
    assert capability == "DEFAULT"
    for seed, flat in values.items():
        want = np.asarray(flat, dtype=np.float32).reshape(1, 64, 16, 20)
        got = comfy_noise(int(seed), want.shape, "scalar")
        assert np.abs(got - want).max() <= 5e-7
        assert (got != want).mean() < 0.05  # libm and correct rounding rarely disagree


def test_vector_and_scalar_differ_only_in_last_bits():
    vector = comfy_noise(5, (1, 64, 8, 8), "vector")
    scalar = comfy_noise(5, (1, 64, 8, 8), "scalar")
    assert np.abs(vector - scalar).max() < 1e-5
    assert (vector != scalar).any()


def test_statistics_and_seeds():
    a = comfy_noise(3, (1, 64, 32, 32))
    assert abs(float(a.mean())) < 0.02 and abs(float(a.std()) - 1.0) < 0.02
    assert not np.array_equal(a, comfy_noise(4, (1, 64, 32, 32)))
    # torch seeds with the low 32 bits only
    np.testing.assert_array_equal(comfy_noise(7, (40,)), comfy_noise(7 + 2**32, (40,)))


def test_fma_rounds_once():
    # (1 + 2**-12)(1 - 2**-12 + 2**-24) = 1 + 2**-36: a product 2**-24 + 2**-60 added to 1 lies
    # just above the float32 midpoint 1 + 2**-24; a float64 sum would round to the midpoint
    # first and then to even (1.0).
    a = np.float32(2.0**-12 * (1 + 2.0**-12))
    b = np.float32(2.0**-12 * (1 - 2.0**-12 + 2.0**-24))
    assert float(a) * float(b) == 2.0**-24 + 2.0**-60
    assert np.float32(float(a) * float(b) + 1.0) == np.float32(1.0)  # the double rounding
    assert fma(a, b, np.float32(1.0)) == np.float32(1.0 + 2.0**-23)
    # an exact tie still goes to even, and the negative side mirrors
    assert fma(np.float32(1.0), np.float32(1.0), np.float32(2.0**-24)) == np.float32(1.0)
    assert fma(-a, b, np.float32(-1.0)) == np.float32(-(1.0 + 2.0**-23))


def test_default_kernel_by_machine():
    assert default_kernel("x86_64") == "vector"
    assert default_kernel("AMD64") == "vector"
    assert default_kernel("arm64") == "scalar"
    assert default_kernel("aarch64") == "scalar"


def test_refusals_and_empty():
    with pytest.raises(ValueError):
        comfy_noise(0, (4,), "cuda")
    assert comfy_noise(0, (0, 3)).shape == (0, 3)
