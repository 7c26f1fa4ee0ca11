"""Z-Image quantized at load, on the tiny folder: the step and the encode of a quantized model
equal the same networks run in float32 with the dequantized weights; a LoRA table applies to a
quantized base; status and manifest report what is resident; and a folder written by
`gmlx model quantize` loads directly and computes what quantizing at load computes."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gmlx_contract.hashing import tensor_hash
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.encoders.qwen3.text import Qwen3TextEncoder
from gmlx_server.engine.families.z_image import family
from gmlx_server.engine.families.z_image.dit import ZImageDiT
from gmlx_server.engine.families.z_image.prompt import ZImagePromptEncoder
from gmlx_server.engine.family import LoadedParts
from gmlx_server.engine.precision import Quantization
from gmlx_server.engine.quantize import BIASES, SCALES
from mlx.utils import tree_flatten

from tests.families.qwen_image21.test_quantized import dequantized_tree, rel_l2
from tests.lora.reference import make_table

TOLERANCE = 1e-4
BITS = (4, 8)
TO_K = "layers.1.attention.to_k.weight"  # a part of a quantized fused weight
X_IN = "all_x_embedder.2-1.weight"  # a layer the family keeps in float


@pytest.fixture(scope="module")
def folder(turbo_folder):
    return turbo_folder  # conftest.py's, read only


@pytest.fixture(scope="module")
def full(folder):
    return family.Z_IMAGE.load(folder, "full")


def dequantized_qwen3(encoder: Qwen3TextEncoder, component_dir) -> Qwen3TextEncoder:
    """A float32 Qwen3 of the same layers holding `encoder`'s weights, the quantized ones
    dequantized (`component_dir`: its float folder, for the config)."""
    plain = Qwen3TextEncoder.load(component_dir, layers=len(encoder.model.layers))
    weights = dict(tree_flatten(encoder.model.parameters()))
    for path, layer in encoder.model.named_modules():
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            weights[path + ".weight"] = mx.dequantize(
                layer.weight,
                layer.scales,
                layer.biases,
                group_size=layer.group_size,
                bits=layer.bits,
            )
            del weights[path + SCALES], weights[path + BIASES]
    plain.model.load_weights(list(weights.items()), strict=True)
    return plain


def dequantized_encoder(prompt: ZImagePromptEncoder, folder) -> ZImagePromptEncoder:
    """The prompt encoder with a float32 Qwen3 holding the dequantized weights."""
    plain = dequantized_qwen3(prompt.encoder, folder / "text_encoder")
    return ZImagePromptEncoder(plain, prompt.tokenizer, prompt.dtype)


def dequantized_model(model: family.ZImageModel, folder) -> family.ZImageModel:
    dit = model.dit
    plain = ZImageDiT(dit.config, dequantized_tree(dit.weights), dit.dtype)
    encoder = dequantized_encoder(model.encoder, folder)
    return family.ZImageModel(
        folder, "plain", LoadedParts(family.FAMILY, model.variant, plain, model.vae, encoder)
    )


@pytest.fixture(scope="module", params=BITS, ids=[f"{bits}bit" for bits in BITS])
def models(request, folder):
    quantized = family.Z_IMAGE.load(folder, "quantized", Quantization(request.param, 32))
    return quantized, dequantized_model(quantized, folder)


def rows_of(cond: np.ndarray) -> list[StepRow]:
    return [StepRow(cond=cond, cond_key="wire:" + tensor_hash(cond))]


def latents(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 16, 6, 8)).astype(np.float32)


def step(model, rows, table=None, seed=2):
    return model.denoise_step(latents(seed), np.array([0.6], np.float32), rows, table=table).out


def test_encode_is_the_dequantized_encoders(models):
    quantized, plain = models
    got = quantized.encode("a red boat at dawn", [], refs=False).cond
    assert rel_l2(got, plain.encode("a red boat at dawn", [], refs=False).cond) <= TOLERANCE
    table = quantized.encoder.encoder.model.embed_tokens
    assert isinstance(table, nn.QuantizedEmbedding)  # the token table is quantized too


def test_step_is_the_dequantized_networks_step(models, full):
    quantized, plain = models
    rows = rows_of(full.encode("a lighthouse", [], refs=False).cond)
    got = step(quantized, rows)
    assert rel_l2(got, step(plain, rows)) <= TOLERANCE
    assert rel_l2(got, step(full, rows)) > 10 * TOLERANCE  # the quantization is real


def lora_table(model, seed: int):
    rng = np.random.default_rng(seed)
    entries, arrays = [], {}
    for key, (out_dim, in_dim) in ((TO_K, (64, 64)), (X_IN, (64, 64))):
        up = rng.standard_normal((out_dim, 2)).astype(np.float32) * 0.3
        down = rng.standard_normal((2, in_dim)).astype(np.float32) * 0.3
        arrays.update({tensor_hash(up): up, tensor_hash(down): down})
        patch = {"up": tensor_hash(up), "down": tensor_hash(down), "strength": 0.8}
        entries.append({"key": "diffusion_model." + key, "band": None, "patches": [patch]})
    return make_table(model, {"entries": entries}, arrays)


def test_a_lora_table_on_a_quantized_base(models, full):
    quantized, plain = models
    rows = rows_of(full.encode("a castle", [], refs=False).cond)
    got = step(quantized, rows, lora_table(quantized, 4))
    assert rel_l2(got, step(plain, rows, lora_table(plain, 4))) <= TOLERANCE
    assert rel_l2(got, step(quantized, rows)) > 10 * TOLERANCE


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


def test_a_stored_quantized_folder_equals_quantizing_at_load(folder, tmp_path):
    written = tmp_path / "z-q4"
    command = [sys.executable, "-m", "gmlx_server", "model", "quantize", str(folder)]
    command += [str(written), "--bits", "4", "--group-size", "32"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    stored = family.Z_IMAGE.load(written, "stored")
    at_load = family.Z_IMAGE.load(folder, "at-load", Quantization(4, 32))
    assert stored.status()["quantization"] == at_load.status()["quantization"]
    assert family.Z_IMAGE.describe(written)["quantization"] == at_load.status()["quantization"]
    assert stored.weight_bytes == at_load.weight_bytes
    cond = at_load.encode("a lighthouse", [], refs=False).cond
    np.testing.assert_array_equal(stored.encode("a lighthouse", [], refs=False).cond, cond)
    np.testing.assert_array_equal(step(stored, rows_of(cond)), step(at_load, rows_of(cond)))
