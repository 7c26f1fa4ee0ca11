"""The MLX AutoencoderKL against diffusers' (float32, tiny random weights): FLUX.1's layout and
one with quant convolutions and another block layout."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.vaes.autoencoder_kl import AutoencoderKL, latent_normalisation

from tests.compare import rel_l2
from tests.families.z_image.tiny.vae import build_vae
from tests.vaes.autoencoder_kl.reference import reference_decode, reference_encode

CONFIGS = {
    "flux1": {},
    "quant_convs": {
        "block_out_channels": (16, 32),
        "down_block_types": ("DownEncoderBlock2D",) * 2,
        "up_block_types": ("UpDecoderBlock2D",) * 2,
        "layers_per_block": 1,
        "latent_channels": 4,
        "use_quant_conv": True,
        "use_post_quant_conv": True,
        "shift_factor": None,
    },
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def vaes(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"autoencoder_kl_{request.param}")
    model = build_vae(folder, seed=2, **CONFIGS[request.param])
    return model, AutoencoderKL.load(folder)


@pytest.mark.parametrize("hw", [(32, 32), (48, 80)])
def test_encode_matches_the_posterior_mean(vaes, hw):
    model, vae = vaes
    image = np.random.default_rng(1).random((1, *hw, 3), dtype=np.float32)
    expected = reference_encode(model, image)
    ours = np.array(vae.encode(mx.array(image)))
    assert ours.shape == expected.shape
    assert rel_l2(ours, expected) <= 1e-4


@pytest.mark.parametrize("hw", [(4, 4), (6, 10)])
def test_decode_matches_the_pipeline(vaes, hw):
    """What the pipeline does after sampling: decode, then x / 2 + 0.5 clamped to [0, 1]."""
    model, vae = vaes
    channels = model.config.latent_channels
    latents = np.random.default_rng(2).standard_normal((1, channels, *hw)).astype(np.float32)
    expected = reference_decode(model, latents)
    ours = np.array(vae.decode(mx.array(latents)))
    assert ours.shape == expected.shape
    assert rel_l2(ours, expected) <= 1e-4


def test_model_space_is_the_pipelines(vaes):
    """The DiT's latents are (z - shift) * scale; the pipeline decodes latents / scale + shift."""
    model, vae = vaes
    z = mx.array(np.random.default_rng(3).standard_normal((1, 4, 2, 2)).astype(np.float32))
    scale, shift = model.config.scaling_factor, model.config.shift_factor or 0.0
    np.testing.assert_allclose(
        np.array(vae.to_model_space(z)), (np.array(z) - shift) * scale, rtol=1e-6
    )
    np.testing.assert_allclose(
        np.array(vae.from_model_space(vae.to_model_space(z))), np.array(z), rtol=1e-5, atol=1e-6
    )


def test_bad_sizes_are_refused(vaes):
    _, vae = vaes
    with pytest.raises(EngineInputError, match="stride"):
        vae.encode(mx.zeros((1, 13, 16, 3)))
    with pytest.raises(EngineInputError, match="latents"):
        vae.decode(mx.zeros((1, 3, 4, 4)))


def test_published_normalisation_is_the_model_space(vaes):
    """Status `vae.latents_mean` / `latents_std`: (z - mean) / std is the model space."""
    model, vae = vaes
    mean, std = latent_normalisation(dict(model.config))
    z = np.random.default_rng(4).standard_normal((1, vae.latent_channels, 2, 2)).astype(np.float32)
    by_status = (z - np.array(mean)[None, :, None, None]) / np.array(std)[None, :, None, None]
    np.testing.assert_allclose(
        np.array(vae.to_model_space(mx.array(z))), by_status, rtol=1e-6, atol=1e-7
    )
