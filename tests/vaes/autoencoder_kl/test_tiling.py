"""Tiled AutoencoderKL passes against diffusers' own tiling (`enable_tiling()`: its tile sides,
overlap and blend) on the same tiny weights, float32: relative L2 <= 1e-4 (measured about 7e-7
decoding and 1.4e-6 encoding on the CPU backend).

The tiny VAE's `sample_size` is 32 pixels here (4 latent cells at stride 8), so small images
already span several tiles: even and uneven grids, a non-square one, and sizes whose last tile
is shorter than the overlap. An image no larger than a tile is not tiled, and stays the untiled
pass; a tiled pass differs from the untiled one (the group norms see one tile), which shows the
comparison would see a pass that did not tile. A pass tiles only when asked (`tiled=True`, the
memory plan's fallback): not asked, it is diffusers' untiled pass at every size.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.vaes.autoencoder_kl import AutoencoderKL

from tests.compare import rel_l2
from tests.families.z_image.tiny.vae import build_vae
from tests.vaes.autoencoder_kl.reference import reference_decode, reference_encode

TILE = 32  # pixels: the VAE's sample_size
# Image sides (pixels): 2x2 tiles, 3x2 uneven ones, and a last tile shorter than the overlap.
SIZES = [(64, 64), (80, 48), (40, 72)]


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autoencoder_kl_tiled")
    model = build_vae(folder, seed=5, sample_size=TILE)
    model.enable_tiling()
    return model, AutoencoderKL.load(folder)


REFERENCE = {"decode": reference_decode, "encode": reference_encode}


def drawn(hw, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Latents of an image `hw` in size (from `seed`) and such an image (from `seed` + 1)."""
    latents = np.random.default_rng(seed).standard_normal((1, 16, hw[0] // 8, hw[1] // 8))
    image = np.random.default_rng(seed + 1).random((1, *hw, 3), dtype=np.float32)
    return latents.astype(np.float32), image


def untiled(model, direction: str, inputs: np.ndarray) -> np.ndarray:
    """diffusers' untiled pass in `direction` (its tiling off for the call)."""
    model.disable_tiling()
    try:
        return REFERENCE[direction](model, inputs)
    finally:
        model.enable_tiling()


@pytest.mark.parametrize("direction", ["decode", "encode"])
@pytest.mark.parametrize("hw", SIZES)
def test_a_tiled_pass_matches_diffusers_tiling(vaes, hw, direction):
    """Each direction, asked to tile, is diffusers' tiled pass (latents and images of the same
    sides: one is the other's output shape), and not its untiled one."""
    model, vae = vaes
    latents, image = drawn(hw, 7)
    inputs, shape = (latents, image.shape) if direction == "decode" else (image, latents.shape)
    assert vae.geometry.tileable(*hw, decode=direction == "decode")
    ours = np.array(getattr(vae, direction)(mx.array(inputs), tiled=True))
    expected = REFERENCE[direction](model, inputs)
    assert ours.shape == expected.shape == shape
    assert rel_l2(ours, expected) <= 1e-4
    assert rel_l2(ours, untiled(model, direction, inputs)) > 1e-3


@pytest.mark.parametrize("hw", SIZES)
def test_a_pass_not_asked_to_tile_is_diffusers_untiled_pass(vaes, hw):
    """Larger than a tile, but not asked to tile (the memory plan asks only where the whole
    pass does not fit): both directions are diffusers' untiled passes."""
    model, vae = vaes
    latents, image = drawn(hw, 11)
    decoded, encoded = untiled(model, "decode", latents), untiled(model, "encode", image)
    assert rel_l2(np.array(vae.decode(mx.array(latents))), decoded) <= 1e-4
    assert rel_l2(np.array(vae.encode(mx.array(image))), encoded) <= 1e-4


def test_an_image_of_one_tile_is_not_tiled(vaes):
    """At sample_size itself diffusers does not tile, and neither does the server."""
    model, vae = vaes
    assert not vae.geometry.tileable(TILE, TILE, decode=True) and not vae.geometry.tileable(
        TILE, TILE, decode=False
    )
    latents = np.random.default_rng(9).standard_normal((1, 16, 4, 4)).astype(np.float32)
    image = np.random.default_rng(10).random((1, TILE, TILE, 3), dtype=np.float32)
    decoded = np.array(vae.decode(mx.array(latents), tiled=True))
    assert rel_l2(decoded, reference_decode(model, latents)) <= 1e-4
    encoded = np.array(vae.encode(mx.array(image), tiled=True))
    assert rel_l2(encoded, reference_encode(model, image)) <= 1e-4


def test_the_tile_side_is_the_configs_sample_size(tmp_path):
    """FLUX.1's VAE config says sample_size 1024: tiles of 1024 pixels, 128 latent cells."""
    build_vae(tmp_path, seed=0, sample_size=1024)
    vae = AutoencoderKL.load(tmp_path)
    assert (vae.geometry.tile_pixels, vae.geometry.tile_cells) == (1024, 128)
    assert not vae.geometry.tileable(1024, 1024, decode=True) and vae.geometry.tileable(
        1024, 1032, decode=True
    )
