"""The MLX AutoencoderKL and AutoencoderKLFlux2 against diffusers' (float32, tiny random weights):
FLUX.1's layout, one with quant convolutions and another block layout, and FLUX.2's in the model
space Flux2KleinPipeline reads and writes (encode as the pipeline encodes a reference: posterior
mean, 2x2 patchify, batch-norm statistics; decode as it decodes its result)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.vaes.autoencoder_kl import AutoencoderKL, latent_normalisation
from gmlx_server.engine.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2

from tests.compare import rel_l2
from tests.families.flux2_klein.tiny import vae as flux2_vae
from tests.families.z_image.tiny import vae as flux1_vae
from tests.vaes.autoencoder_kl import reference


@dataclass(frozen=True)
class Case:
    """A tiny VAE (its builder, config and seed), the MLX class, the pipeline's encode and
    decode, and the latent sizes its decode test takes."""

    build: Any
    config: dict
    network: Any
    encode: Any
    decode: Any
    seed: int = 2
    latent_sides: tuple = ((4, 4), (6, 10))


QUANT_CONVS = {
    "block_out_channels": (16, 32),
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "layers_per_block": 1,
    "latent_channels": 4,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "shift_factor": None,
}
PLAIN = (AutoencoderKL, reference.reference_encode, reference.reference_decode)
FLUX2 = (AutoencoderKLFlux2, reference.flux2_reference_encode, reference.flux2_reference_decode)
CASES = {
    "flux1": Case(flux1_vae.build_vae, {}, *PLAIN),
    "quant_convs": Case(flux1_vae.build_vae, QUANT_CONVS, *PLAIN),
    "flux2": Case(flux2_vae.build_vae, {}, *FLUX2, seed=3, latent_sides=((2, 2), (3, 5))),
}
PLAIN_CASES = [name for name, case in sorted(CASES.items()) if case.network is AutoencoderKL]
_BUILT: dict[str, tuple] = {}


def built(name: str, tmp_path_factory) -> tuple:
    """(case, diffusers' model, the MLX VAE) of the tiny VAE `name`, built once per session."""
    if name not in _BUILT:
        case = CASES[name]
        folder = tmp_path_factory.mktemp(f"autoencoder_kl_{name}")
        model = case.build(folder, seed=case.seed, **case.config)
        _BUILT[name] = case, model, case.network.load(folder)
    return _BUILT[name]


@pytest.fixture(params=sorted(CASES))
def vaes(request, tmp_path_factory):
    return built(request.param, tmp_path_factory)


@pytest.fixture(params=PLAIN_CASES)
def plain_vaes(request, tmp_path_factory):
    """(diffusers' model, the MLX VAE) of an AutoencoderKL (not FLUX.2's)."""
    return built(request.param, tmp_path_factory)[1:]


@pytest.mark.parametrize("hw", [(32, 32), (48, 80)])
def test_encode_matches_the_pipeline(vaes, hw):
    """AutoencoderKL's: the posterior mean."""
    case, model, vae = vaes
    image = np.random.default_rng(1).random((1, *hw, 3), dtype=np.float32)
    expected = case.encode(model, image)
    ours = np.array(vae.encode(mx.array(image)))
    cells = (hw[0] // vae.stride, hw[1] // vae.stride)
    assert ours.shape == expected.shape == (1, vae.latent_channels, *cells)
    assert rel_l2(ours, expected) <= 1e-4


@pytest.mark.parametrize("side", [0, 1])
def test_decode_matches_the_pipeline(vaes, side):
    """What the pipeline does after sampling: decode, then x / 2 + 0.5 clamped to [0, 1]."""
    case, model, vae = vaes
    hw = case.latent_sides[side]
    shape = (1, vae.latent_channels, *hw)
    latents = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    expected = case.decode(model, latents)
    ours = np.array(vae.decode(mx.array(latents)))
    assert ours.shape == expected.shape == (1, hw[0] * vae.stride, hw[1] * vae.stride, 3)
    assert rel_l2(ours, expected) <= 1e-4


def test_sizes_off_the_stride_are_refused(vaes):
    _, _, vae = vaes
    with pytest.raises(EngineInputError, match=f"stride {vae.stride}"):
        vae.encode(mx.zeros((1, vae.stride + 5, 2 * vae.stride, 3)))
    with pytest.raises(EngineInputError, match=f"latents are \\(B, {vae.latent_channels}"):
        vae.decode(mx.zeros((1, 3, 4, 4)))


def test_the_flux2_statistics_matter(tmp_path_factory):
    """Decoding FLUX.2's latents without its batch-norm statistics gives another image: the
    decode test reads them."""
    _, _, vae = built("flux2", tmp_path_factory)
    latents = mx.array(np.random.default_rng(4).standard_normal((1, 128, 2, 2)), mx.float32)
    plain = vae.body.decode(vae.unpatchify(latents))
    assert rel_l2(np.array(vae.decode(latents)), np.array(plain)) > 0.01


def test_model_space_is_the_pipelines(plain_vaes):
    """The DiT's latents are (z - shift) * scale; the pipeline decodes latents / scale + shift."""
    model, vae = plain_vaes
    z = mx.array(np.random.default_rng(3).standard_normal((1, 4, 2, 2)).astype(np.float32))
    scale, shift = model.config.scaling_factor, model.config.shift_factor or 0.0
    np.testing.assert_allclose(
        np.array(vae.to_model_space(z)), (np.array(z) - shift) * scale, rtol=1e-6
    )
    np.testing.assert_allclose(
        np.array(vae.from_model_space(vae.to_model_space(z))), np.array(z), rtol=1e-5, atol=1e-6
    )


def test_published_normalisation_is_the_model_space(plain_vaes):
    """Status `vae.latents_mean` / `latents_std`: (z - mean) / std is the model space."""
    model, vae = plain_vaes
    mean, std = latent_normalisation(dict(model.config))
    z = np.random.default_rng(4).standard_normal((1, vae.latent_channels, 2, 2)).astype(np.float32)
    by_status = (z - np.array(mean)[None, :, None, None]) / np.array(std)[None, :, None, None]
    np.testing.assert_allclose(
        np.array(vae.to_model_space(mx.array(z))), by_status, rtol=1e-6, atol=1e-7
    )
