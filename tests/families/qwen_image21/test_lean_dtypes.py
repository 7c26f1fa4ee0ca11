"""The text encoder's and the VAE's compute dtype: `nn.dtypes.encoder_vae_dtype`'s rule (float32
on the CPU backend, where bf16 is no faster; bf16 on GPU backends), and the bf16 path run on the
CPU by forcing the model entry's setting: the RGBA decode and the encode stay within a bf16
tolerance of float32, in half the bytes (every family's conditioning and RGB decode at bf16:
tests/families/test_conformance.py).

The tolerance: bf16 keeps 8 significant bits (unit roundoff 2**-9, about 2e-3), and every
weight and activation of the networks is rounded to it, so their outputs move by a few units
of roundoff per layer. Measured on the embedded model (bench/lean_dtypes.py): 1.5e-2 for the
conditioning (the last decoder layer's states before the final norm, which grow layer by
layer), 0.8e-2 for a decode and 1.2e-2 for an encode. The bounds are about 3x those, and far
below what a wrong network gives (relative L2 near 1); the floor shows the bf16 path ran
(float32 against itself differs by about 1e-7)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.qwen_image21 import family
from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
from gmlx_server.engine.nn.dtypes import default_compute_dtype, encoder_vae_dtype

from tests.compare import rel_l2

VAE_TOLERANCE = 0.03
BF16_FLOOR = 1e-4


def test_the_rule_is_float32_on_the_cpu_unless_a_setting_names_a_dtype():
    assert mx.default_device() == mx.cpu
    assert encoder_vae_dtype() == mx.float32 == encoder_vae_dtype("auto")
    assert default_compute_dtype() == mx.float32  # the DiT's rule, the same on this backend
    names = {"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}
    assert {name: encoder_vae_dtype(name) for name in names} == names


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = ensure_embedded_model(tmp_path_factory.mktemp("embedded"))
    return family.QWEN_IMAGE21.load(folder, "f32"), family.QWEN_IMAGE21.load(
        folder, "bf16", encoder_vae_dtype="bf16"
    )


def test_the_status_names_each_components_dtype(models):
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
    assert bf16.status()["compute_dtype"] == "f32"
    # every encoder and VAE weight is a float cast to bf16: half the bytes
    assert bf16.encoder_bytes * 2 == f32.encoder_bytes
    assert bf16.vae.weight_bytes * 2 == f32.vae.weight_bytes
    assert residency["encoder"]["bytes"] == bf16.encoder_bytes
    assert bf16.weight_bytes == f32.weight_bytes - bf16.encoder_bytes - bf16.vae.weight_bytes


def test_the_bf16_vae_is_within_the_tolerance(models):
    f32, bf16 = models
    rng = np.random.default_rng(3)
    latents = rng.standard_normal((64, 8, 12)).astype(np.float32)
    want, got = f32.vae_decode(latents, alpha=True), bf16.vae_decode(latents, alpha=True)
    assert got.dtype == np.float32 and got.shape == want.shape == (128, 192, 4)
    assert BF16_FLOOR < rel_l2(got, want) <= VAE_TOLERANCE
    image = rng.random((128, 192, 4)).astype(np.float32)
    want, got = f32.vae_encode(image), bf16.vae_encode(image)
    assert got.shape == want.shape == (64, 8, 12)
    assert BF16_FLOOR < rel_l2(got, want) <= VAE_TOLERANCE
