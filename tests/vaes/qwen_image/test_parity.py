"""Qwen-Image's VAE (Krea 2's) in MLX against diffusers' AutoencoderKLQwenImage on tiny random
weights, float32: encode, decode, and tiled passes against untiled ones."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.vaes.qwen_image import QwenImageVAE

from tests.compare import rel_l2
from tests.families.tiny_weights import redraw
from tests.vaes.qwen_image21.reference import reference_decode, reference_encode

TOLERANCE = 1e-4
TILED_BOUND = 1e-6
# A tiny AutoencoderKLQwenImage: four levels (stride 8), attention in the mid blocks only, as
# the real one; another layout with two resnets a level and a temporal downsample first.
CONFIGS = {
    "krea2": {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1},
    "other": {
        "base_dim": 8,
        "z_dim": 4,
        "dim_mult": [1, 2, 4, 2],
        "num_res_blocks": 2,
        "temperal_downsample": [True, False, True],
        "latents_mean": [0.1, -0.2, 0.3, 0.0],
        "latents_std": [1.5, 0.7, 2.0, 1.0],
    },
}


def tiny_vae(config: dict, seed: int):
    """diffusers' AutoencoderKLQwenImage of `config`, random weights of the tests' spread."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    model = AutoencoderKLQwenImage(**config)
    redraw(
        model,
        torch.Generator().manual_seed(seed),
        linear_gain=1.0,
        constant_noise=0.2,
        is_linear=lambda name, param: param.ndim >= 2,
    )
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    model = tiny_vae(CONFIGS[request.param], 7)
    folder = tmp_path_factory.mktemp(f"qwen_image_vae_{request.param}")
    model.save_pretrained(str(folder))
    return QwenImageVAE.load(folder), model.eval()


@pytest.mark.parametrize("size", [(32, 32), (40, 56)])
def test_encode_equals_the_reference(tiny, size):
    vae, model = tiny
    image = np.random.default_rng(1).random((1, *size, 3), dtype=np.float32)
    got = np.array(vae.encode(mx.array(image)))
    assert got.shape == (1, vae.z_dim, size[0] // 8, size[1] // 8)
    assert rel_l2(got, reference_encode(model, image)) <= TOLERANCE


@pytest.mark.parametrize("cells", [(4, 4), (5, 7)])
def test_decode_equals_the_reference(tiny, cells):
    vae, model = tiny
    latents = np.random.default_rng(2).standard_normal((1, vae.z_dim, *cells)).astype(np.float32)
    got = np.array(vae.decode(mx.array(latents)))
    assert got.shape == (1, cells[0] * 8, cells[1] * 8, 3)
    assert rel_l2(got, reference_decode(model, latents)) <= TOLERANCE


def test_tiled_passes_equal_untiled_ones(tiny):
    vae, _ = tiny
    latents = np.random.default_rng(3).standard_normal((1, vae.z_dim, 10, 7)).astype(np.float32)
    image = np.random.default_rng(4).random((1, 80, 56, 3), dtype=np.float32)
    vae.tile_cells = 10_000
    untiled = np.array(vae.decode(mx.array(latents))), np.array(vae.encode(mx.array(image)))
    vae.tile_cells = 3
    tiled = np.array(vae.decode(mx.array(latents))), np.array(vae.encode(mx.array(image)))
    assert rel_l2(tiled[0], untiled[0]) <= TILED_BOUND
    assert rel_l2(tiled[1], untiled[1]) <= TILED_BOUND
