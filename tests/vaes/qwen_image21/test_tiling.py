"""Tiled passes against untiled ones.

Tiles carry a halo as wide as the receptive field of the local layers, and the mid blocks'
global attention runs once on the whole latent, so a tiled pass equals the untiled pass up to
float rounding. Stated bound: relative L2 <= 1e-6 (measured 0.0 on the CPU backend). Cutting the
halos to a third must break that bound, which shows the comparison can see a seam.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import numpy as np
import pytest
from diffusers import AutoencoderKLQwenImage21
from gmlx_server.engine.vaes import qwen_image21 as vae_module
from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE

from tests.compare import rel_l2
from tests.vaes.qwen_image21.reference import reference_decode, reference_encode

TILED_BOUND = 1e-6
# Latent cells (h, w) and tile side: 3x3 tiles, and 4x3 uneven ones on a non-square latent.
LAYOUTS = [((12, 12), 4), ((10, 7), 3)]


@pytest.fixture
def vae(rgba_vae):
    return QwenImage21VAE.load(rgba_vae[0])


@pytest.mark.parametrize("direction", ["decode", "encode"])
@pytest.mark.parametrize(("cells", "tile"), LAYOUTS)
def test_a_tiled_pass_equals_the_untiled_one(vae, rgba_vae, cells, tile, direction):
    """Each direction in tiles of `tile` cells equals it whole (tiles larger than the latent),
    and diffusers' pass."""
    latents = np.random.default_rng(11).standard_normal((1, vae.z_dim, *cells)).astype(np.float32)
    size = (cells[0] * 16, cells[1] * 16, vae.in_channels)
    image = np.random.default_rng(12).random((1, *size), dtype=np.float32)
    inputs = mx.array(latents if direction == "decode" else image)
    vae.tile_cells = 10_000
    untiled = np.array(getattr(vae, direction)(inputs))
    vae.tile_cells = tile
    tiled = np.array(getattr(vae, direction)(inputs))
    assert rel_l2(tiled, untiled) <= TILED_BOUND
    reference = {"decode": reference_decode, "encode": reference_encode}[direction]
    assert rel_l2(tiled, reference(rgba_vae[1], np.array(inputs))) <= 1e-4


def test_short_halos_leave_seams(vae, monkeypatch):
    latents = np.random.default_rng(13).standard_normal((1, vae.z_dim, 12, 12)).astype(np.float32)
    image = np.random.default_rng(14).random((1, 192, 192, vae.in_channels), dtype=np.float32)
    vae.tile_cells = 10_000
    untiled = np.array(vae.decode(mx.array(latents))), np.array(vae.encode(mx.array(image)))

    full_reach = vae_module._run_tiled

    def third_of_the_reach(x, stages, px_per_cell, cells, tile_cells):
        short = [vae_module.Stage(s.run, s.reach / 3, s.px_per_cell) for s in stages]
        return full_reach(x, short, px_per_cell, cells, tile_cells)

    monkeypatch.setattr(vae_module, "_run_tiled", third_of_the_reach)
    vae.tile_cells = 4
    assert rel_l2(vae.decode(mx.array(latents)), untiled[0]) > 100 * TILED_BOUND
    assert rel_l2(vae.encode(mx.array(image)), untiled[1]) > 100 * TILED_BOUND


def test_big_images_tile_by_default(vae, monkeypatch):
    """A latent wider than the chosen tile side goes through the tiler without being asked."""
    calls = []
    real = vae_module._run_tiled

    def spy(x, stages, px_per_cell, cells, tile_cells):
        calls.append((cells, tile_cells))
        return real(x, stages, px_per_cell, cells, tile_cells)

    monkeypatch.setattr(vae_module, "_run_tiled", spy)
    side = vae.tile_cells
    assert side == vae_module.MAX_TILE_CELLS  # the tiny VAE is far under the budget
    assert vae.decode(mx.zeros((1, vae.z_dim, 1, side + 1))).shape == (1, 16, 16 * (side + 1), 4)
    vae.decode(mx.zeros((1, vae.z_dim, 1, side)))
    assert calls == [((1, side + 1), side)]


@pytest.mark.parametrize(("dtype", "expected"), [(mx.float32, 26), (mx.bfloat16, 38)])
def test_full_size_tiles_fit_the_budget(dtype, expected):
    """The real VAE's default config (diffusers' defaults): tiles shrink to fit the budget."""
    defaults = inspect.signature(AutoencoderKLQwenImage21.__init__).parameters
    config = {name: p.default for name, p in defaults.items() if name != "self"}
    vae = QwenImage21VAE(config, dtype)  # no weights needed to plan tiles
    stage_lists = [vae.model.encoder.stages(), vae.model.decoder.stages()]

    def largest(cells):
        return max(vae_module._largest_tile_bytes(s, cells, dtype.size) for s in stage_lists)

    assert vae.tile_cells == expected
    assert largest(expected) <= vae_module.TILE_ACTIVATION_BUDGET < largest(expected + 1)


def test_spans_cover_the_latent_in_near_equal_parts():
    assert vae_module._spans(12, 4) == [(0, 4), (4, 8), (8, 12)]
    assert vae_module._spans(10, 3) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert vae_module._spans(128, 64) == [(0, 64), (64, 128)]
    assert vae_module._spans(5, 64) == [(0, 5)]
