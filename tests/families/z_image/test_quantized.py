"""Z-Image quantized at load, on the tiny folder, beyond the conformance suite's quantized
checks (tests/families/test_conformance.py: a quantized load computes as its dequantized
weights, a LoRA table on it too): status and manifest report what is resident, the token table
quantized too, and a folder written by `gmlx model quantize` loads directly and computes what
quantizing at load computes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gmlx_contract.hashing import tensor_hash
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.z_image import family
from gmlx_server.engine.precision import Quantization

from tests.engine.quantized import quantized_by_command


@pytest.fixture(scope="module")
def folder(turbo_folder):
    return turbo_folder  # conftest.py's, read only


@pytest.fixture(scope="module")
def full(folder):
    return family.Z_IMAGE.load(folder, "full")


def rows_of(cond: np.ndarray) -> list[StepRow]:
    return [StepRow(cond=cond, cond_key="wire:" + tensor_hash(cond))]


def latents(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 16, 6, 8)).astype(np.float32)


def step(model, rows, table=None, seed=2):
    return model.denoise_step(latents(seed), np.array([0.6], np.float32), rows, table=table).out


def test_status_and_manifest_report_what_is_resident(folder, full):
    quantized = family.Z_IMAGE.load(folder, "q", Quantization(4, 32))
    spec = {"bits": 4, "group_size": 32, "mode": "affine"}
    assert quantized.status()["quantization"] == {"dit": spec, "encoder": spec, "vae": None}
    assert full.status()["quantization"] == {"dit": None, "encoder": None, "vae": None}
    assert family.Z_IMAGE.describe(folder)["quantization"] == full.status()["quantization"]
    assert quantized.manifest() == full.manifest()
    weights = quantized.dit.weights
    assert weights["layers"][0]["qkv"].dtype == mx.uint32
    assert weights["layers"][0]["modulation"].dtype == mx.float32
    for kept in ("x_in", "cap_in", "final", "final_modulation", "time_1"):
        assert weights[kept].dtype == mx.float32
    assert quantized.dit.weight_bytes < full.dit.weight_bytes
    assert isinstance(quantized.encoder.encoder.model.embed_tokens, nn.QuantizedEmbedding)


def test_a_stored_quantized_folder_equals_quantizing_at_load(folder, tmp_path):
    written = quantized_by_command(folder, tmp_path / "z-q4", 4, 32)
    stored = family.Z_IMAGE.load(written, "stored")
    at_load = family.Z_IMAGE.load(folder, "at-load", Quantization(4, 32))
    assert stored.status()["quantization"] == at_load.status()["quantization"]
    assert family.Z_IMAGE.describe(written)["quantization"] == at_load.status()["quantization"]
    assert stored.weight_bytes == at_load.weight_bytes
    cond = at_load.encode("a lighthouse", [], refs=False).cond
    np.testing.assert_array_equal(stored.encode("a lighthouse", [], refs=False).cond, cond)
    np.testing.assert_array_equal(step(stored, rows_of(cond)), step(at_load, rows_of(cond)))
