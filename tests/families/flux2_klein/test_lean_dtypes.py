"""FLUX.2 klein's text encoder and VAE at the model entry's `encoder_vae_dtype`
(nn.dtypes.encoder_vae_dtype: float32 on the CPU backend, bf16 on GPU backends), the bf16 path
run on the CPU by forcing the setting: the conditioning, the decode and the encode stay within
a bf16 tolerance of float32 (the bounds of Qwen-Image 2.1's test: bf16's unit roundoff is about
2e-3 and every layer rounds to it), in half the bytes; the DiT keeps its own dtype."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.families.flux2_klein import family

from .tiny.folder import build_tiny_folder

ENCODE_TOLERANCE = 0.05
VAE_TOLERANCE = 0.03
BF16_FLOOR = 1e-4  # float32 against itself differs by about 1e-7: the bf16 path ran
PROMPT = "a red fox in the snow"


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_lean") / "klein-tiny"
    build_tiny_folder(folder)
    return family.FLUX2_KLEIN.load(folder, "f32"), family.FLUX2_KLEIN.load(
        folder, "bf16", encoder_vae_dtype="bf16"
    )


def test_the_status_names_each_components_dtype_and_bytes(models):
    f32, bf16 = models
    assert {name: c["dtype"] for name, c in f32.status()["residency"].items()} == {
        "dit": "f32",
        "encoder": "f32",
        "vae": "f32",
    }
    residency = bf16.status()["residency"]
    assert {name: c["dtype"] for name, c in residency.items()} == {
        "dit": "f32",  # the DiT keeps its own rule
        "encoder": "bf16",
        "vae": "bf16",
    }
    f32_rows = f32.status()["residency"]
    assert residency["encoder"]["bytes"] * 2 == f32_rows["encoder"]["bytes"]
    # the batch norm's statistics stay float32
    assert residency["vae"]["bytes"] < f32_rows["vae"]["bytes"] * 0.51
    assert residency["dit"]["bytes"] == f32_rows["dit"]["bytes"]


def test_the_bf16_conditioning_is_within_the_tolerance(models):
    f32, bf16 = models
    want, got = f32.encode(PROMPT, [], refs=False), bf16.encode(PROMPT, [], refs=False)
    assert got.cond.dtype == np.float32 and got.cond.shape == want.cond.shape
    assert BF16_FLOOR < rel_l2(got.cond, want.cond) <= ENCODE_TOLERANCE


def test_the_bf16_vae_is_within_the_tolerance(models):
    f32, bf16 = models
    rng = np.random.default_rng(3)
    channels = f32.status()["latent"]["channels"]
    latents = rng.standard_normal((channels, 4, 6)).astype(np.float32)
    want, got = f32.vae_decode(latents, alpha=False), bf16.vae_decode(latents, alpha=False)
    assert got.dtype == np.float32 and got.shape == want.shape == (64, 96, 3)
    assert BF16_FLOOR < rel_l2(got, want) <= VAE_TOLERANCE
    image = rng.random((64, 96, 3)).astype(np.float32)
    want, got = f32.vae_encode(image), bf16.vae_encode(image)
    assert got.dtype == np.float32 and got.shape == want.shape == (channels, 4, 6)
    assert BF16_FLOOR < rel_l2(got, want) <= VAE_TOLERANCE
