"""FLUX.2 klein's Qwen3 text encoder quantized at load, stored quantized by `gmlx model quantize`
and read from a llama.cpp GGUF file (a model entry's `text_encoder`), on tiny folders: each
encodes as the same network run in float32 on its dequantized weights (for a GGUF file, the
weights `gguf.quants.dequantize` gives); the decoder layers after the last tapped one never
load; status reports each component's precision and residency, its unloaded estimate the bytes
a load holds."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_contract import wire
from gmlx_server.config import ModelSettings, ServerConfig
from gmlx_server.engine.families.flux2_klein import family
from gmlx_server.engine.families.flux2_klein.prompt import (
    LOADED_LAYERS,
    TAPPED_LAYERS,
    Flux2PromptEncoder,
)
from gmlx_server.engine.ggml_blocks import BlockEmbedding, BlockLinear
from gmlx_server.engine.gguf import READABLE
from gmlx_server.engine.precision import BITS, Quantization
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.weights import read_config
from safetensors.numpy import save_file

from tests.compare import rel_l2
from tests.encoders.qwen3.test_gguf import write_encoder_gguf
from tests.engine.quantized import dequantized_qwen3, quantized_by_command
from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.families.flux2_klein.tiny.text_encoder import TINY_TEXT, build_text_encoder
from tests.server.conftest import serve

TOLERANCE = 1e-4
PROMPT = "a red fox in the snow"
# Wide enough that every linear input (256, 512) takes a K-quant's 256-blocks.
WIDE_TEXT = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
}
TYPES = list(READABLE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2_encoder") / "klein-tiny"
    build_tiny_folder(root)
    return root


@pytest.fixture(scope="module")
def full(folder):
    return family.FLUX2_KLEIN.load(folder, "full")


def dequantized(prompt: Flux2PromptEncoder, folder) -> Flux2PromptEncoder:
    """The prompt encoder with a float32 Qwen3 holding its weights dequantized."""
    plain = dequantized_qwen3(prompt.encoder, folder / "text_encoder")
    return Flux2PromptEncoder(plain, prompt.tokenizer, prompt.pad_id, prompt.dtype)


def spec(bits: int, group_size: int = 32) -> dict:
    return {"bits": bits, "group_size": group_size, "mode": "affine"}


# Every width quantizes the shared Qwen3 encoder as its dequantized weights encode, token table
# included, in tests/families/z_image/test_quantized.py, and the conformance suite encodes every
# family's at 4 and 8 bits; klein's own path (its token table, its norms) runs here at 4 bits,
# and at the others with -m heavy.
@pytest.mark.parametrize(
    "bits", [b if b == 4 else pytest.param(b, marks=pytest.mark.heavy) for b in BITS]
)
def test_a_quantized_encoder_encodes_as_its_dequantized_weights(folder, full, bits):
    model = family.FLUX2_KLEIN.load(folder, "quantized", Quantization(bits, 32))
    layers = dict(model.encoder.encoder.model.named_modules())
    assert isinstance(layers["embed_tokens"], nn.QuantizedEmbedding)  # the token table too
    assert isinstance(layers["layers.0.self_attn.q_proj"], nn.QuantizedLinear)
    assert isinstance(layers["layers.0.input_layernorm"], nn.RMSNorm)  # norms stay float
    got = model.encode(PROMPT, [], refs=False).cond
    expected = dequantized(model.encoder, folder).encode(PROMPT)
    assert rel_l2(got, expected) <= TOLERANCE
    assert rel_l2(got, full.encode(PROMPT, [], refs=False).cond) > 10 * TOLERANCE
    assert model.status()["quantization"] == {"dit": spec(bits), "encoder": spec(bits), "vae": None}
    assert model.encoder.weight_bytes < full.encoder.weight_bytes


def test_the_layers_after_the_last_tapped_one_never_load(folder, full):
    assert read_config(folder / "text_encoder")["num_hidden_layers"] == 28
    assert len(full.encoder.encoder.model.layers) == LOADED_LAYERS == 27
    # the unloaded estimate counts what a load holds: no layer 27, no lm_head, no final norm
    residency = family.FLUX2_KLEIN.describe(folder)["residency"]
    assert residency["encoder"]["bytes"] == full.encoder.weight_bytes
    assert residency["dit"]["bytes"] == full.dit.weight_bytes
    narrow = folder.parent / "narrow"
    shutil.copytree(folder, narrow)
    config = json.loads((narrow / "text_encoder" / "config.json").read_text())
    config["num_hidden_layers"] = 26
    (narrow / "text_encoder" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has 26 decoder layers; the family reads the first 27"):
        Flux2PromptEncoder.load(narrow)


# The encode route on every family's quantized load against its dequantized weights, and the
# status from the files against the loaded one, are the conformance suite's; `--quantize` on
# klein's route, with its residency bytes, runs with -m heavy.
@pytest.mark.heavy
def test_the_encode_route_on_a_quantized_model(folder, full):
    config = ServerConfig(host="127.0.0.1", port=0)
    config = replace(config, quantization=Quantization(4, 32))
    registry = ModelRegistry(
        [], folder.name, extra_models=[folder], settings=config.load_settings_for
    )
    server = serve(config, registry)
    try:
        unloaded = server.call("GET", f"models/{folder.name}/status").json()
        assert unloaded["quantization"] == {"dit": None, "encoder": None, "vae": None}
        r = server.post_json("encode", {"model": folder.name, "text": PROMPT})
        assert r.status_code == 200, r.text
        got = wire.read_container(r.content).tensors["cond"]
        model = registry.loaded(folder.name).model
        assert rel_l2(got, dequantized(model.encoder, folder).encode(PROMPT)) <= TOLERANCE
        assert rel_l2(got, full.encode(PROMPT, [], refs=False).cond) > 10 * TOLERANCE
        status = server.call("GET", f"models/{folder.name}/status").json()
        assert status["quantization"] == {"dit": spec(4), "encoder": spec(4), "vae": None}
        encoder = status["residency"]["encoder"]
        assert encoder["resident"] and encoder["quantization"] == spec(4)
        assert encoder["dtype"] == "f32" and encoder["bytes"] == model.encoder.weight_bytes
        assert encoder["bytes"] < unloaded["residency"]["encoder"]["bytes"] * 0.5
    finally:
        server.close()


def test_a_stored_quantized_folder_equals_quantizing_at_load(folder, tmp_path):
    written = quantized_by_command(folder, tmp_path / "klein-q4", 4, 32)
    for component in ("transformer", "text_encoder"):
        assert read_config(written / component)["quantization"] == spec(4)
    stored = family.FLUX2_KLEIN.load(written, "stored")
    at_load = family.FLUX2_KLEIN.load(folder, "at-load", Quantization(4, 32))
    assert family.FLUX2_KLEIN.describe(written)["quantization"] == at_load.status()["quantization"]
    assert stored.status()["quantization"] == at_load.status()["quantization"]
    assert stored.weight_bytes == at_load.weight_bytes
    assert (
        family.FLUX2_KLEIN.describe(written)["residency"]["encoder"]["bytes"]
        == stored.encoder.weight_bytes
    )
    cond = at_load.encode(PROMPT, [], refs=False).cond
    np.testing.assert_array_equal(stored.encode(PROMPT, [], refs=False).cond, cond)
    # a quantize setting at its own precision changes nothing; at another it is refused
    same = family.FLUX2_KLEIN.load(written, "same", Quantization(4, 32))
    np.testing.assert_array_equal(same.encode(PROMPT, [], refs=False).cond, cond)
    with pytest.raises(ValueError, match="stored quantized"):
        family.FLUX2_KLEIN.load(written, "other", Quantization(8, 32))


# ---------------------------------------------------------------------------------------------
# Qwen3 from a llama.cpp GGUF file, as Z-Image reads it


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A klein text encoder and tokenizer folder whose linears all take K-quant blocks."""
    return build_text_encoder(tmp_path_factory.mktemp("flux2_wide") / "wide", **WIDE_TEXT)


def reference_folder(source, target, held: dict):
    """A copy of `source`'s text encoder and tokenizer holding `held`'s weights in float32."""
    shutil.copytree(source, target)
    weights = {name: np.ascontiguousarray(v, np.float32) for name, v in held.items()}
    file = next((target / "text_encoder").glob("*.safetensors"))
    save_file(weights, str(file))
    return target


def tapped(prompt: Flux2PromptEncoder) -> np.ndarray:
    """The three tapped layers' states of PROMPT's tokens, unpadded (the padded encode of the
    wide encoder is slow on the CPU backend; the tiny folder's model entry test runs it)."""
    ids, length = prompt.token_ids(PROMPT)
    states = prompt.encoder.hidden_states(ids[:length], TAPPED_LAYERS)
    return np.concatenate([np.array(state) for state in states], axis=-1)


# Every type reads as gguf's weights on the shared Qwen3 encoder
# (tests/encoders/qwen3/test_gguf.py); klein's own path (its tapped layers, the file's last
# layer unread, the quantized token table) runs here on a float, an exact and a nearest type,
# and on the others with -m heavy.
KLEIN_TYPES = (T.F16, T.Q4_K, T.Q6_K)


@pytest.mark.parametrize(
    "kind",
    [
        kind if kind in KLEIN_TYPES else pytest.param(kind, marks=pytest.mark.heavy)
        for kind in TYPES
    ],
    ids=lambda kind: kind.name,
)
def test_a_gguf_encoder_encodes_as_the_dequantized_weights(kind, wide, tmp_path):
    path = tmp_path / "Qwen3-wide.gguf"
    held = write_encoder_gguf(path, wide / "text_encoder", kind, np.random.default_rng(int(kind)))
    encoder = Flux2PromptEncoder.load(wide, gguf=path)
    got = tapped(encoder)
    expected = Flux2PromptEncoder.load(reference_folder(wide, tmp_path / "ref", held))
    error = rel_l2(got, tapped(expected))
    print(f"{kind.name}: rel-L2 {error:.3g} against gguf's weights")
    assert error <= TOLERANCE
    layers = dict(encoder.encoder.model.named_modules())
    quantized = kind not in (T.F32, T.F16, T.BF16)
    assert isinstance(layers["layers.0.mlp.down_proj"], BlockLinear) == quantized
    assert isinstance(layers["embed_tokens"], BlockEmbedding) == quantized
    assert len(encoder.encoder.model.layers) == LOADED_LAYERS  # the file's layer 27 unread


def test_a_model_entrys_text_encoder_gguf(folder, full, tmp_path):
    """A model entry's `text_encoder` (Q8_0: the tiny encoder's 32-wide inputs): refused when
    of the wrong shapes, else reported by status and encoding as gguf's weights; a quantize
    setting leaves the file's quantized layers as they are."""
    path = tmp_path / "Qwen3-tiny-Q8_0.gguf"
    held = write_encoder_gguf(path, folder / "text_encoder", T.Q8_0, np.random.default_rng(5))
    wrong = tmp_path / "wrong.gguf"
    write_encoder_gguf(wrong, wide_encoder(tmp_path), T.Q8_0, np.random.default_rng(6))
    with pytest.raises(ValueError, match=r"wrong\.gguf: tensor "):
        family.FLUX2_KLEIN.check(folder, text_encoder=wrong)
    plain = reference_folder(folder, tmp_path / "plain", held)
    expected = family.FLUX2_KLEIN.load(plain, "plain").encode(PROMPT, [], refs=False).cond
    config = ServerConfig(host="127.0.0.1", port=0)
    config.models[folder.name] = ModelSettings(text_encoder=path, quantization=Quantization(4, 32))
    registry = ModelRegistry(
        [],
        folder.name,
        extra_models=[folder],
        settings=config.load_settings_for,
    )
    server = serve(config, registry)
    try:
        status = server.call("GET", f"models/{folder.name}/status").json()
        matrices = sum(v.ndim == 2 for v in held.values())
        gguf_status = {
            "format": "gguf",
            "file": path.name,
            "types": {"F32": len(held) - matrices, "Q8_0": matrices},
            "weights": "blocks",
            "bits_per_weight": 8.5,  # Q8_0's 34 bytes per 32 weights, as the file holds them
        }
        assert status["quantization"]["encoder"] == gguf_status
        assert status["memory"]["encoder_bytes"] > status["residency"]["encoder"]["bytes"]
        r = server.post_json("encode", {"model": folder.name, "text": PROMPT})
        assert r.status_code == 200, r.text
        assert rel_l2(wire.read_container(r.content).tensors["cond"], expected) <= TOLERANCE
        model = registry.loaded(folder.name).model
        assert model.status()["quantization"]["encoder"] == gguf_status
        assert model.status()["quantization"]["dit"] == spec(4)
        q_proj = dict(model.encoder.encoder.model.named_modules())["layers.0.self_attn.q_proj"]
        assert q_proj.layout.types == (T.Q8_0,)  # as the file holds it
    finally:
        server.close()


def wide_encoder(tmp_path):
    """A text encoder folder of another width (its GGUF file does not fit the tiny config)."""
    root = build_text_encoder(tmp_path / "other", **{**TINY_TEXT, "hidden_size": 64})
    return root / "text_encoder"
