"""The MLX AutoencoderKLFlux2 against diffusers' (float32, tiny random weights), in the model
space Flux2KleinPipeline reads and writes: encode as the pipeline encodes a reference
(posterior mean, 2x2 patchify, batch-norm statistics), decode as it decodes its result."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2

from tests.compare import rel_l2
from tests.families.flux2_klein.tiny.vae import build_vae
from tests.vaes.autoencoder_kl.reference import flux2_reference_decode, flux2_reference_encode


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autoencoder_kl_flux2")
    model = build_vae(folder, seed=3)
    return model, AutoencoderKLFlux2.load(folder)


@pytest.mark.parametrize("hw", [(32, 32), (48, 80)])
def test_encode_matches_the_pipeline(vaes, hw):
    model, vae = vaes
    image = np.random.default_rng(1).random((1, *hw, 3), dtype=np.float32)
    expected = flux2_reference_encode(model, image)
    ours = np.array(vae.encode(mx.array(image)))
    assert ours.shape == expected.shape == (1, 128, hw[0] // 16, hw[1] // 16)
    assert rel_l2(ours, expected) <= 1e-4


@pytest.mark.parametrize("hw", [(2, 2), (3, 5)])
def test_decode_matches_the_pipeline(vaes, hw):
    model, vae = vaes
    latents = np.random.default_rng(2).standard_normal((1, 128, *hw)).astype(np.float32)
    expected = flux2_reference_decode(model, latents)
    ours = np.array(vae.decode(mx.array(latents)))
    assert ours.shape == expected.shape == (1, hw[0] * 16, hw[1] * 16, 3)
    assert rel_l2(ours, expected) <= 1e-4


def test_the_statistics_matter(vaes):
    """Decoding without the batch-norm statistics gives another image: the test above reads
    them."""
    _, vae = vaes
    latents = mx.array(np.random.default_rng(4).standard_normal((1, 128, 2, 2)), mx.float32)
    plain = vae.body.decode(vae.unpatchify(latents))
    assert rel_l2(np.array(vae.decode(latents)), np.array(plain)) > 0.01


def test_refuses_sizes_off_the_stride(vaes):
    _, vae = vaes
    with pytest.raises(EngineInputError, match="stride 16"):
        vae.encode(mx.zeros((1, 24, 32, 3)))
    with pytest.raises(EngineInputError, match="128"):
        vae.decode(mx.zeros((1, 32, 2, 2)))
