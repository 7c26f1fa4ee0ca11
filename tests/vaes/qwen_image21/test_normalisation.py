"""Latent normalisation against the pipeline: encode as _encode_vae_image does, decode as __call__."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.image_processor import VaeImageProcessor
from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE
from PIL import Image

from tests.compare import rel_l2


def test_statistics_come_from_the_config(rgba_vae):
    directory, model = rgba_vae
    vae = QwenImage21VAE.load(directory)
    np.testing.assert_array_equal(vae.latents_mean, np.float32(model.config.latents_mean))
    np.testing.assert_array_equal(vae.latents_std, np.float32(model.config.latents_std))
    assert vae.latents_mean.dtype == vae.latents_std.dtype == np.float32


def test_encode_to_model_space_matches_the_pipeline(rgba_vae):
    """A PIL RGBA picture through the pipeline's preprocess and _encode_vae_image."""
    directory, model = rgba_vae
    vae = QwenImage21VAE.load(directory)
    pixels = np.random.default_rng(21).integers(0, 256, (48, 80, 4), dtype=np.uint8)
    picture = Image.fromarray(pixels, mode="RGBA")

    processor = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=vae.z_dim)
    batch = processor.preprocess(picture, width=80, height=48).unsqueeze(2)
    pipeline = SimpleNamespace(vae=model, latent_channels=vae.z_dim)
    with torch.no_grad():
        expected = QwenImage21Pipeline._encode_vae_image(pipeline, batch, generator=None)

    image = mx.array(pixels[None].astype(np.float32) / 255.0)
    got = np.array(vae.to_model_space(vae.encode(image)))
    assert rel_l2(got, expected[:, :, 0].numpy()) <= 1e-4


def test_from_model_space_decode_matches_the_pipeline(rgba_vae):
    """The pipeline's decode: latents * std + mean, vae.decode(...)[:, :, 0], postprocess."""
    directory, model = rgba_vae
    vae = QwenImage21VAE.load(directory)
    latents = np.random.default_rng(22).standard_normal((1, vae.z_dim, 3, 5)).astype(np.float32)

    shape = (1, vae.z_dim, 1, 1, 1)
    mean = torch.tensor(model.config.latents_mean).view(shape)
    std = torch.tensor(model.config.latents_std).view(shape)
    with torch.no_grad():
        raw = torch.from_numpy(latents)[:, :, None] * std + mean
        image = model.decode(raw, return_dict=False)[0][:, :, 0]
    processor = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=vae.z_dim)
    expected = processor.postprocess(image, output_type="pt").permute(0, 2, 3, 1).numpy()

    got = np.array(vae.decode(vae.from_model_space(mx.array(latents))))
    assert rel_l2(got, expected) <= 1e-4


def test_model_space_round_trip(rgba_vae):
    vae = QwenImage21VAE.load(rgba_vae[0])
    latents = mx.array(np.random.default_rng(23).standard_normal((2, vae.z_dim, 3, 4)), mx.float32)
    back = vae.from_model_space(vae.to_model_space(latents))
    np.testing.assert_allclose(np.array(back), np.array(latents), rtol=1e-5, atol=1e-6)
    normalised = np.array(vae.to_model_space(latents))
    expected = (np.array(latents) - vae.latents_mean[:, None, None]) / vae.latents_std[
        :, None, None
    ]
    np.testing.assert_allclose(normalised, expected, rtol=1e-6, atol=1e-6)
