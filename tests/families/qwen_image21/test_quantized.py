"""Qwen-Image 2.1 quantized at load, on the embedded default model: the step and the encode of a
quantized model equal the same networks run in float32 with the dequantized weights, at each bit
width; a LoRA table applies to a quantized base; a prefix-state hit equals a miss; status,
manifest and memory report what is resident; a configured `quantize` reaches the loaded model
through the server; and sampling through the step routes equals sampling in process."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gmlx_contract.client import StepClient
from gmlx_contract.hashing import tensor_hash
from gmlx_server.config import ModelSettings, ServerConfig
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.encoders.qwen3.vl import Qwen3VLEncoder
from gmlx_server.engine.families.qwen_image21 import family
from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
from gmlx_server.engine.families.qwen_image21.prompt import QwenImage21PromptEncoder
from gmlx_server.engine.family import LoadedParts
from gmlx_server.engine.load_settings import LoadSettings
from gmlx_server.engine.nn.dtypes import tree_bytes
from gmlx_server.engine.precision import BITS, Quantization
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import ImageRequest, generate
from gmlx_server.model_choice import ModelChoice
from gmlx_server.step_server import StepServer, ViaStepsTransport

from tests.compare import rel_l2
from tests.engine.quantized import dequantized_parameters, dequantized_tree
from tests.lora.reference import make_table
from tests.server.conftest import serve

TOLERANCE = 1e-4
QKV = "transformer_blocks.1.attn.to_k.weight"  # a part of a quantized fused weight
IMG_IN = "img_in.weight"  # a layer the family keeps in float


def dequantized_encoder(prompt: QwenImage21PromptEncoder, folder) -> QwenImage21PromptEncoder:
    """The prompt encoder with a float32 Qwen3-VL holding the dequantized weights."""
    plain, _ = Qwen3VLEncoder.load(folder / "text_encoder")
    plain.load_weights(dequantized_parameters(prompt.encoder), strict=True)
    return QwenImage21PromptEncoder(plain, prompt.tokenizer, prompt.preprocessor, 0, prompt.dtype)


def dequantized_model(quantized: family.QwenImage21Model, folder) -> family.QwenImage21Model:
    dit = quantized.dit
    plain_dit = QwenImage21DiT(dit.config, dequantized_tree(dit.weights), dit.dtype)
    encoder = dequantized_encoder(quantized.encoder, folder)
    parts = LoadedParts(quantized.family, quantized.variant, plain_dit, quantized.vae, encoder)
    return family.QWEN_IMAGE21.build(folder, "dequantized", parts)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("embedded"))


@pytest.fixture(scope="module")
def full(folder):
    return family.QWEN_IMAGE21.load(folder, "full")


@pytest.fixture(scope="module", params=BITS, ids=[f"{bits}bit" for bits in BITS])
def models(request, folder):
    """(quantized, the same networks with the dequantized weights in float32)."""
    quantized = family.QWEN_IMAGE21.load(folder, "quantized", Quantization(request.param))
    return quantized, dequantized_model(quantized, folder)


def reference_image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (256, 320, 3), dtype=np.uint8)


def rows_of(encoding) -> list[StepRow]:
    refs = tuple(latents[0] for latents in encoding.ref_latents)
    return [
        StepRow(
            cond=encoding.cond,
            cond_key="wire:" + tensor_hash(encoding.cond),
            ref_latents=refs,
            ref_keys=tuple(tensor_hash(r) for r in refs),
            image_slots=tuple(encoding.image_slots),
        )
    ]


def latents(seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 64, 4, 6)).astype(np.float32)


def test_encode_is_the_dequantized_encoders(models):
    quantized, plain = models
    images = [reference_image(0)]
    got = quantized.encode("a red boat at dawn", images, refs=True)
    expected = plain.encode("a red boat at dawn", images, refs=True)
    assert rel_l2(got.cond, expected.cond) <= TOLERANCE
    assert got.image_slots == expected.image_slots
    np.testing.assert_array_equal(got.ref_latents[0], expected.ref_latents[0])  # the same VAE
    table = quantized.encoder.encoder.language_model.embed_tokens
    assert isinstance(table, nn.QuantizedEmbedding)  # the token table is quantized too


def test_step_is_the_dequantized_networks_step(models, full):
    quantized, plain = models
    rows = rows_of(full.encode("a lighthouse", [reference_image(1)], refs=True))
    x, sigma = latents(2), np.array([0.7], np.float32)
    got = quantized.denoise_step(x, sigma, rows).out
    assert rel_l2(got, plain.denoise_step(x, sigma, rows).out) <= TOLERANCE
    # the quantization is real: the float model's step differs
    assert rel_l2(got, full.denoise_step(x, sigma, rows).out) > 10 * TOLERANCE


def lora_table(model, seed: int):
    rng = np.random.default_rng(seed)
    entries, arrays = [], {}
    for key, (out_dim, in_dim) in ((QKV, (128, 128)), (IMG_IN, (128, 64))):
        up = rng.standard_normal((out_dim, 2)).astype(np.float32) * 0.3
        down = rng.standard_normal((2, in_dim)).astype(np.float32) * 0.3
        arrays.update({tensor_hash(up): up, tensor_hash(down): down})
        patch = {"up": tensor_hash(up), "down": tensor_hash(down), "strength": 0.8}
        entries.append({"key": "diffusion_model." + key, "band": None, "patches": [patch]})
    return make_table(model, {"entries": entries}, arrays)


def test_a_lora_table_on_a_quantized_base(models, full):
    quantized, plain = models
    rows = rows_of(full.encode("a castle", [], refs=False))
    x, sigma = latents(3), np.array([0.4], np.float32)
    table = lora_table(quantized, 4)
    got = quantized.denoise_step(x, sigma, rows, table=table).out
    expected = plain.denoise_step(x, sigma, rows, table=lora_table(plain, 4)).out
    assert rel_l2(got, expected) <= TOLERANCE
    assert rel_l2(got, quantized.denoise_step(x, sigma, rows).out) > 10 * TOLERANCE
    # the pairs stay float beside the packed weight
    block = quantized.tables.weights_for(table)["blocks"][1]
    assert block["qkv"].dtype == mx.uint32 and block["qkv.lora_down"].dtype == mx.float32


def test_a_prefix_state_hit_equals_a_miss(models, full):
    quantized, _ = models
    rows = rows_of(full.encode("a harbour", [reference_image(5)], refs=True))
    x, sigma = latents(6), np.array([0.5], np.float32)
    for table in (None, lora_table(quantized, 7)):
        miss = quantized.denoise_step(x, sigma, rows, table=table, run="r")
        hit = quantized.denoise_step(x, sigma, rows, table=table, run="r")
        assert (miss.prefix_cache, hit.prefix_cache) == ("miss", "hit")
        np.testing.assert_array_equal(hit.out, miss.out)
    quantized.end_run("r")


def test_status_manifest_and_memory_report_what_is_resident(folder, full):
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    quantized = family.QWEN_IMAGE21.load(folder, "q", Quantization(4, 32))
    # tensor by tensor: the load peaks near the quantized bytes, never the float model's
    assert mx.get_peak_memory() - before <= quantized.weight_bytes * 1.1 < full.weight_bytes
    status = quantized.status()
    spec = {"bits": 4, "group_size": 32, "mode": "affine"}
    assert status["quantization"] == {"dit": spec, "encoder": spec, "vae": None}
    assert full.status()["quantization"] == {"dit": None, "encoder": None, "vae": None}
    assert family.QWEN_IMAGE21.describe(folder)["quantization"] == full.status()["quantization"]
    # the manifest keeps the files' logical shapes: a client's LoRA keys still match
    assert quantized.manifest() == full.manifest()
    weights = quantized.dit.weights
    assert weights["blocks"][0]["qkv"].dtype == mx.uint32
    for kept in ("img_in", "text_in", "modulation", "norm_out", "proj_out", "time_1"):
        assert weights[kept].dtype == mx.float32
    # memory counts the arrays held: packed words, scales and biases
    encoder_bytes = tree_bytes(quantized.encoder.encoder.parameters())
    dit_bytes = tree_bytes(weights)
    assert quantized.weight_bytes == dit_bytes + encoder_bytes + quantized.vae.weight_bytes
    assert dit_bytes < full.dit.weight_bytes * 0.6
    reserve = family.QWEN_IMAGE21.activation_reserve(folder, quantized.dit.dtype)
    assert status["memory"]["resident_bytes"] == quantized.weight_bytes + reserve
    assert status["memory"]["resident_bytes"] < full.status()["memory"]["resident_bytes"]


def test_a_configured_quantize_reaches_the_loaded_model(folder):
    config = ServerConfig(host="127.0.0.1", port=0)
    config.models[folder.name] = ModelSettings(quantization=Quantization(6))
    registry = ModelRegistry(
        [], folder.name, extra_models=[folder], settings=config.load_settings_for
    )
    server = serve(config, registry)
    try:
        before = server.call("GET", f"models/{folder.name}/status").json()
        assert before["resident"] is False and before["quantization"]["dit"] is None
        assert server.post_json("models/load", {"model": folder.name}).status_code == 200
        after = server.call("GET", f"models/{folder.name}/status").json()
        spec = {"bits": 6, "group_size": 64, "mode": "affine"}
        assert after["quantization"] == {"dit": spec, "encoder": spec, "vae": None}
        manifest = server.call("GET", f"models/{folder.name}/manifest").json()
        shapes = {t["name"]: t["shape"] for t in manifest["tensors"]}
        assert shapes[QKV] == [128, 128] and manifest["model"] == folder.name
        # the memory planner counts the quantized arrays the model holds
        model = registry.loaded(folder.name).model
        planner = server.ctx.service.memory
        caches = sum(cache.total for cache in planner.caches)
        assert planner.held(states=False) == model.weight_bytes + caches
        assert model.weight_bytes == (
            tree_bytes(model.dit.weights)
            + tree_bytes(model.encoder.encoder.parameters())
            + model.vae.weight_bytes
        )
        assert (
            model.weight_bytes
            < family.QWEN_IMAGE21.estimated_weight_bytes(folder, model.dit.dtype) * 0.7
        )
    finally:
        server.close()


def test_equal_to_direct_holds_with_quantize_4(folder, tmp_path):
    """`gmlx image bench --via-steps --quantize 4`: the step routes and the in-process sampler
    reach the same latents bit for bit on the quantized model."""
    out = tmp_path / "record.json"
    command = [sys.executable, "-m", "gmlx_server", "image", "bench", "--via-steps"]
    command += ["--quantize", "4", "--model", str(folder), "--width", "64", "--height", "48"]
    command += ["--cfg", "1.0", "--runs", "1", "--warmup", "0", "--json-out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["transport"]["equal_to_direct"] is True
    spec = {"bits": 4, "group_size": 64, "mode": "affine"}
    assert record["model"]["dit"]["quantization"] == spec
    assert record["model"]["encoder"]["quantization"] == spec


def test_guided_sampling_with_a_reference_via_steps_equals_direct(folder):
    registry = ModelRegistry(
        extra_models=[folder],
        default_model=folder.name,
        settings=lambda _: LoadSettings(Quantization(4)),
    )
    request = ImageRequest(
        prompt="a windmill",
        negative="fog",
        width=64,
        height=64,
        seed=3,
        cfg=3.0,
        images=(reference_image(8),),
    )
    with StepServer(ModelChoice(registry, folder.name, 0.0)) as server:
        loaded = server.load()
        status = loaded.model.status()
        assert status["quantization"]["dit"]["bits"] == 4
        with StepClient(server.base_url) as client:
            via = ViaStepsTransport(client, server.direct(), folder.name)
            through_routes, _ = generate(via, status, request)
        direct, _ = generate(server.direct(), status, request)
    np.testing.assert_array_equal(through_routes, direct)
