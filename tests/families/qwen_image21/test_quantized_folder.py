"""`gmlx model quantize`: a model folder holding quantized weights (`X.weight` packed,
`X.scales`, `X.biases`, the `quantization` in each config) that loads directly, never through
float weights, and computes what quantizing at load computes."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gmlx_contract.errors import ContractError
from gmlx_server.engine.families.qwen_image21 import family
from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
from gmlx_server.engine.load_settings import LoadSettings
from gmlx_server.engine.precision import Quantization
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.weights import read_header, weight_files

from tests.engine.quantized import quantize_command
from tests.families.qwen_image21.test_quantized import (
    latents,
    lora_table,
    reference_image,
    rows_of,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    source = ensure_embedded_model(root / "source")
    written = root / "q4"
    result = quantize_command(str(source), str(written), "--bits", "4", "--group-size", "32")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"wrote {written} (4-bit, groups of 32)" in result.stdout
    return source, written


def test_the_files_hold_the_quantized_weights_and_say_so(folders):
    source, written = folders
    for component in ("transformer", "text_encoder"):
        config = json.loads((written / component / "config.json").read_text())
        assert config["quantization"] == {"bits": 4, "group_size": 32, "mode": "affine"}
    header = read_header(weight_files(written / "transformer")[0])
    qkv = "transformer_blocks.0.attn.to_q"
    assert header[qkv + ".weight"]["dtype"] == "U32"
    assert header[qkv + ".weight"]["shape"] == [128, 128 * 4 // 32]
    assert header[qkv + ".scales"]["shape"] == [128, 128 // 32]
    assert header["img_in.weight"]["dtype"] == "F32" and "img_in.scales" not in header
    encoder = read_header(weight_files(written / "text_encoder")[0])
    assert any(name.endswith("mlp.up_proj.scales") for name in encoder)
    assert any(name.endswith("embed_tokens.scales") for name in encoder)  # the token table too
    assert not any("patch_embed" in name and name.endswith(".scales") for name in encoder)
    # everything else is copied as it was
    for name in ("model_index.json", "vae/config.json", "processor/tokenizer.json"):
        assert (written / name).read_bytes() == (source / name).read_bytes()


def test_the_folder_loads_directly_as_quantizing_at_load_does(folders):
    source, written = folders
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    stored = family.QWEN_IMAGE21.load(written, "stored")
    peak = mx.get_peak_memory() - before
    at_load = family.QWEN_IMAGE21.load(source, "at-load", Quantization(4, 32))
    float_model = family.QWEN_IMAGE21.load(source, "float")
    # never the float weights: the load peaks near the quantized bytes
    assert peak <= stored.weight_bytes * 1.1 < float_model.weight_bytes
    assert stored.weight_bytes == at_load.weight_bytes
    status = stored.status()["quantization"]
    assert (
        status
        == at_load.status()["quantization"]
        == family.QWEN_IMAGE21.describe(written)["quantization"]
    )
    rows = rows_of(at_load.encode("a lighthouse", [reference_image(1)], refs=True))
    x, sigma = latents(2), np.array([0.6], np.float32)
    np.testing.assert_array_equal(
        stored.denoise_step(x, sigma, rows).out, at_load.denoise_step(x, sigma, rows).out
    )
    prompt = ("a boat", [reference_image(3)], True)
    np.testing.assert_array_equal(stored.encode(*prompt).cond, at_load.encode(*prompt).cond)
    # a LoRA table applies to the stored weights as to those quantized at load
    np.testing.assert_array_equal(
        stored.denoise_step(x, sigma, rows, table=lora_table(stored, 5)).out,
        at_load.denoise_step(x, sigma, rows, table=lora_table(at_load, 5)).out,
    )


def test_a_stored_folder_not_loaded_is_estimated_at_its_quantized_bytes(folders):
    """Status of a folder not loaded: the DiT as it will load (packed weights, scales and
    biases as stored), not its logical shapes at float32."""
    source, written = folders
    estimate = family.QWEN_IMAGE21.describe(written)["residency"]
    stored = family.QWEN_IMAGE21.load(written, "stored")
    assert estimate["dit"]["bytes"] == stored.dit.weight_bytes
    assert estimate["dit"]["quantization"] == {"bits": 4, "group_size": 32, "mode": "affine"}
    # the encoder's file holds lm_head beside what loads, as the float folder's does
    floats = family.QWEN_IMAGE21.describe(source)["residency"]["encoder"]["bytes"]
    assert stored.encoder_bytes < estimate["encoder"]["bytes"] < floats
    assert family.QWEN_IMAGE21.estimated_weight_bytes(written, mx.float32) < 0.7 * (
        family.QWEN_IMAGE21.estimated_weight_bytes(source, mx.float32)
    )


def test_the_manifest_keeps_the_logical_shapes(folders):
    source, written = folders
    stored, plain = family.QWEN_IMAGE21.manifest(written), family.QWEN_IMAGE21.manifest(source)
    shapes = {t["name"]: t["shape"] for t in plain["tensors"]}
    assert {t["name"]: t["shape"] for t in stored["tensors"]} == shapes
    dtypes = {t["name"]: t["dtype"] for t in stored["tensors"]}
    assert dtypes["transformer_blocks.0.attn.to_q.weight"] == "quant"
    assert dtypes["img_in.weight"] == "f32"


def test_a_stored_quantized_folder_is_not_quantized_again(folders):
    _, written = folders
    with pytest.raises(ValueError, match="stored quantized .4-bit, groups of 32.; load it without"):
        family.QWEN_IMAGE21.load(written, "again", Quantization(8))
    same = family.QWEN_IMAGE21.load(
        written, "same", Quantization(4, 32)
    )  # as stored: nothing to do
    assert same.weight_bytes == family.QWEN_IMAGE21.load(written, "plain").weight_bytes
    # through the registry, as `gmlx image sample --model FOLDER --quantize 8` loads it: the
    # refusal names the stored precision, not a mismatch with the family
    registry = ModelRegistry(
        extra_models=[written], settings=lambda _: LoadSettings(quantization=Quantization(8))
    )
    with pytest.raises(ContractError) as refused:
        registry.acquire(written.name)
    assert refused.value.status == 400
    assert refused.value.message.startswith(f"model {written.name!r} (qwen_image21) cannot load:")
    assert "is stored quantized (4-bit, groups of 32); load it without quantize" in (
        refused.value.message
    )


def test_bad_commands_are_refused(folders, tmp_path):
    source, written = folders
    exists = quantize_command(str(source), str(written), "--bits", "4")
    assert exists.returncode == 2 and "exists; name a new folder" in exists.stderr
    not_model = quantize_command(str(tmp_path), str(tmp_path / "out"), "--bits", "4")
    assert not_model.returncode == 2 and "is not a diffusers model folder" in not_model.stderr
    unknown = quantize_command("no-such-model", str(tmp_path / "out"), "--bits", "4")
    assert unknown.returncode == 2 and "no model folder 'no-such-model'" in unknown.stderr
    twice = quantize_command(str(written), str(tmp_path / "twice"), "--bits", "8")
    assert twice.returncode == 2 and "is stored quantized already; quantize the" in twice.stderr
    assert not (tmp_path / "twice").exists()
    bits = quantize_command(str(source), str(tmp_path / "out"), "--bits", "7")
    assert bits.returncode == 2 and "invalid choice: 7" in bits.stderr


def test_a_model_id_of_the_configuration_is_quantized_as_its_folder(folders, tmp_path):
    """As `gmlx image sample --model` takes it: the id of a folder under model_dirs."""
    source, written = folders
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nmodel_dirs = ["{source.parent}"]\n')
    by_id = tmp_path / "by-id"
    result = quantize_command(
        source.name, str(by_id), "--bits", "4", "--group-size", "32", "--config", str(config)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for component in ("transformer", "text_encoder"):
        for file in weight_files(written / component):
            assert (by_id / component / file.name).read_bytes() == file.read_bytes()
