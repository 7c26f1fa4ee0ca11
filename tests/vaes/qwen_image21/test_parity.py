"""MLX VAE against diffusers' AutoencoderKLQwenImage21 in float32 (relative L2 <= 1e-4)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE

from tests.compare import rel_l2
from tests.vaes.qwen_image21.reference import reference_decode, reference_encode

# (height, width): odd multiples of the stride, a single latent cell, a non-square one.
SIZES = [(48, 80), (16, 16), (64, 32)]
BAR = 1e-4


@pytest.mark.parametrize("size", SIZES)
def test_encode_matches_diffusers(tiny_vae, size):
    directory, model = tiny_vae
    vae = QwenImage21VAE.load(directory)
    rng = np.random.default_rng(sum(size))
    image = rng.random((1, *size, vae.in_channels), dtype=np.float32)
    expected = reference_encode(model, image)
    got = np.array(vae.encode(mx.array(image)))
    assert got.dtype == np.float32
    assert got.shape == (1, vae.z_dim, size[0] // 16, size[1] // 16) == expected.shape
    assert rel_l2(got, expected) <= BAR


@pytest.mark.parametrize("size", SIZES)
def test_decode_matches_diffusers(tiny_vae, size):
    directory, model = tiny_vae
    vae = QwenImage21VAE.load(directory)
    rng = np.random.default_rng(sum(size) + 1)
    latents = rng.standard_normal((1, vae.z_dim, size[0] // 16, size[1] // 16)).astype(np.float32)
    expected = reference_decode(model, latents)
    got = np.array(vae.decode(mx.array(latents)))
    assert got.dtype == np.float32
    assert got.shape == (1, *size, vae.out_channels) == expected.shape
    assert got.min() >= 0.0 and got.max() <= 1.0
    assert rel_l2(got, expected) <= BAR


def test_batches_are_images_one_by_one(rgba_vae):
    directory, model = rgba_vae
    vae = QwenImage21VAE.load(directory)
    rng = np.random.default_rng(7)
    latents = rng.standard_normal((2, vae.z_dim, 2, 3)).astype(np.float32)
    images = np.array(vae.decode(mx.array(latents)))
    for index in range(2):
        expected = reference_decode(model, latents[index : index + 1])
        assert rel_l2(images[index : index + 1], expected) <= BAR
    encoded = np.array(vae.encode(mx.array(images)))
    for index in range(2):
        expected = reference_encode(model, images[index : index + 1])
        assert rel_l2(encoded[index : index + 1], expected) <= BAR


def test_bfloat16_stays_close(rgba_vae):
    """bf16 weights and activations: a loose sanity bound, not a parity bar."""
    directory, model = rgba_vae
    vae = QwenImage21VAE.load(directory, dtype=mx.bfloat16)
    rng = np.random.default_rng(8)
    latents = rng.standard_normal((1, vae.z_dim, 3, 2)).astype(np.float32)
    got = np.array(vae.decode(mx.array(latents)))
    assert got.dtype == np.float32
    assert rel_l2(got, reference_decode(model, latents)) <= 5e-2
