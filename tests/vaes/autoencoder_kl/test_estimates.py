"""The AutoencoderKL's memory estimate bounds the measured MLX peak of a pass (tiny FLUX.1
checkpoint, float32), untiled and tiled (a VAE whose sample_size, the tile side, is 64 pixels:
the tiled peak is one tile's, far below the whole image's)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.vaes.autoencoder_kl import AutoencoderKL

from tests.families.estimates import peak_of
from tests.families.z_image.tiny.vae import build_vae

TILED_SAMPLE_SIZE = 64


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autoencoder_kl_memory")
    build_vae(folder, seed=4)
    return AutoencoderKL.load(folder)


@pytest.fixture(scope="module")
def tiled_vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autoencoder_kl_memory_tiled")
    build_vae(folder, seed=4, sample_size=TILED_SAMPLE_SIZE)
    return AutoencoderKL.load(folder)


# 256x384 repeats the untiled bound that 128x128 shows, at four times the cost; it runs with
# -m heavy. The tiled check below runs at 256x384.
@pytest.mark.parametrize(
    ("height", "width"), [(128, 128), pytest.param(256, 384, marks=pytest.mark.heavy)]
)
@pytest.mark.parametrize("decode", [True, False])
def test_estimate_bounds_the_measured_peak(vae, height, width, decode):
    assert not vae.geometry.tileable(height, width, decode)
    check_estimate(vae, height, width, decode)


def test_an_untiled_pass_of_a_tileable_image_is_estimated_whole(tiled_vae):
    """Not asked to tile, a pass larger than a tile runs whole: its estimate is the whole
    image's, as the VAE whose tile is larger gives it."""
    check_estimate(tiled_vae, 128, 128, True, tiled=False)


# 512x512 (64 tiles) repeats the bound that 256x384 (24 tiles, both directions) shows at a
# quarter of the cost; it runs with -m heavy.
@pytest.mark.parametrize(
    ("height", "width"), [(256, 384), pytest.param(512, 512, marks=pytest.mark.heavy)]
)
@pytest.mark.parametrize("decode", [True, False])
def test_estimate_bounds_the_measured_tiled_peak(vae, tiled_vae, height, width, decode):
    assert tiled_vae.geometry.tileable(height, width, decode)
    check_estimate(tiled_vae, height, width, decode, tiled=True)
    tiled = tiled_vae.peak_bytes(height, width, decode, tiled=True)
    assert tiled < vae.peak_bytes(height, width, decode) / 4


def check_estimate(vae, height, width, decode, tiled=False):
    rng = np.random.default_rng(3)
    if decode:
        z = mx.array(rng.standard_normal((1, 16, height // 8, width // 8), dtype=np.float32))
        measured = peak_of(lambda: vae.decode(z, tiled))
    else:
        image = mx.array(rng.random((1, height, width, 3), dtype=np.float32))
        measured = peak_of(lambda: vae.encode(image, tiled))
    estimate = vae.peak_bytes(height, width, decode, tiled)
    print(
        f"{'decode' if decode else 'encode'} {width}x{height}: measured"
        f" {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB"
    )
    assert 1.05 * measured <= estimate <= 2 * measured
