"""Step previews (engine/previews.py): the affine latent-to-colour map fitted to a model's VAE,
and the previews a sampling hands out."""

from __future__ import annotations

import numpy as np
from gmlx_server.engine.previews import LatentPreview, cell_colours, preview_for, probe_image

STRIDE, CHANNELS = 8, 6


def linear_encoder(mixing: np.ndarray):
    """A stand-in VAE encoder whose latents are an affine function of each cell's colour (what
    a trained VAE's latents roughly are, and what ComfyUI's latent2rgb previews assume)."""

    def encode(pixels: np.ndarray) -> np.ndarray:
        rows, cols = pixels.shape[0] // STRIDE, pixels.shape[1] // STRIDE
        colours = cell_colours(np.rint(pixels * 255).astype(np.uint8), rows, cols)
        inputs = np.concatenate([colours, np.ones((rows, cols, 1), np.float32)], axis=-1)
        return (inputs @ mixing).transpose(2, 0, 1)[None].astype(np.float32)

    return encode


def test_the_fitted_map_gives_a_held_out_picture_its_colours():
    rng = np.random.default_rng(0)
    encode = linear_encoder(rng.normal(size=(4, CHANNELS)))
    preview = LatentPreview.fit(encode)
    rows, cols = np.mgrid[0:64, 0:96]
    picture = np.stack([rows * 3, cols * 2, 255 - rows * 3], axis=-1).astype(np.uint8)
    latents = encode(picture.astype(np.float32) / 255)
    expected = cell_colours(picture, 64 // STRIDE, 96 // STRIDE)
    assert np.abs(preview.colours(latents) - expected).max() < 1e-3
    shown = preview.picture(latents, 96, 64)
    assert shown.shape == (64, 96, 3) and shown.dtype == np.uint8


def test_a_model_is_fitted_once(monkeypatch):
    calls = []
    encode = linear_encoder(np.eye(4, CHANNELS))

    def counted(pixels):
        calls.append(pixels.shape)
        return encode(pixels)

    class Model:
        pass

    model = Model()
    first = preview_for(model, counted)
    assert preview_for(model, counted) is first
    assert calls == [probe_image().shape]


def test_a_sampling_hands_out_one_denoised_estimate_per_step():
    from gmlx_server.engine.sampling import Guidance, linear_sigmas, sample

    noise = np.random.default_rng(1).normal(size=(1, 2, 3, 3)).astype(np.float32)
    clean = np.full_like(noise, 0.5)
    seen = []

    def step(x, timestep, rows):  # the exact velocity towards `clean`: dx/dsigma = noise - x0
        return np.repeat(noise - clean, len(rows), axis=0)

    sample(
        step, noise, linear_sigmas(4), Guidance("row"), on_denoised=lambda i, x0: seen.append(x0)
    )
    assert len(seen) == 4
    for estimate in seen:
        np.testing.assert_allclose(estimate, clean, atol=1e-6)
