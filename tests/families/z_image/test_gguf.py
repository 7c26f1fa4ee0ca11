"""Z-Image's DiT from a GGUF file, in diffusers' naming or in ComfyUI's (its Lumina2 `NextDiT`:
a fused `attention.qkv`, `attention.out`, `q_norm`/`k_norm`, `x_embedder`, `final_layer`, an
unused `norm_final`), which is what the Z-Image GGUF files ComfyUI-GGUF converts hold: the step
equals the same networks run in float32 with the weights `gguf.quants.dequantize` gives
(relative L2 <= 1e-4; the types with no exact MLX form equal their own dequantized weights'
networks), for every type the server reads; the manifest lists the diffusers names; a
quantize setting still quantizes the file's float layers; a file of the wrong shapes is
refused naming it."""

from __future__ import annotations

import re
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import (
    convert_z_image_transformer_checkpoint_to_diffusers,
)
from gguf import GGMLQuantizationType as T
from gmlx_server.config import ModelSettings, ServerConfig
from gmlx_server.engine.families.z_image import family
from gmlx_server.engine.families.z_image.dit import DiTConfig, ZImageDiT, tensor_shapes
from gmlx_server.engine.family import LoadedParts
from gmlx_server.engine.ggml_blocks import LAYOUT, BlockLayout
from gmlx_server.engine.gguf import READABLE, GGUFError
from gmlx_server.engine.precision import Quantization
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.weights import load_weights, read_config
from safetensors.numpy import save_file

from tests.compare import rel_l2
from tests.engine.gguf_files import encoded, reference, write_dit, write_gguf
from tests.engine.quantized import dequantized_tree
from tests.families.z_image.test_quantized import rows_of, step
from tests.families.z_image.tiny.folder import build_tiny_folder
from tests.server.conftest import serve

TOLERANCE = 1e-4
# dim 96: the feed-forward's 256-wide input takes a K-quant's 256-blocks, every other linear
# input (96, 32, 64, 256, 1024) a 32-block type.
TRANSFORMER = {"dim": 96, "n_heads": 2, "n_kv_heads": 2, "axes_dims": (16, 16, 16)}
TYPES = list(READABLE)
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("z_gguf") / "z-image-tiny"
    build_tiny_folder(root, variant="turbo", **TRANSFORMER)
    return root


@pytest.fixture(scope="module")
def weights(base):
    return {n: np.array(v) for n, v in load_weights(base / "transformer", mx.float32).items()}


@pytest.fixture(scope="module")
def rows(base):
    return rows_of(family.Z_IMAGE.load(base, "encoder").encode("a red boat", [], refs=False).cond)


def types_for(kind: T, config: DiTConfig) -> dict[str, T]:
    """`kind` for every linear weight whose input its blocks divide (else Q8_0); biases, norms
    and pad tokens F32."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[kind][0]
    types = {}
    for name, shape in tensor_shapes(config).items():
        if len(shape) == 2 and name.endswith(".weight"):
            types[name] = kind if shape[1] % block == 0 else T.Q8_0
    return types


def comfy_layout(config: DiTConfig) -> dict[str, tuple[str, ...]]:
    """ComfyUI's names of the diffusers tensors (the inverse of diffusers' single-file
    conversion), file name -> the diffusers tensors whose rows it holds."""
    layout = {}
    for name in tensor_shapes(config):
        comfy = name.replace("all_x_embedder.2-1.", "x_embedder.")
        comfy = comfy.replace("all_final_layer.2-1.", "final_layer.")
        comfy = comfy.replace(".attention.to_out.0.", ".attention.out.")
        comfy = comfy.replace(".attention.norm_q.", ".attention.q_norm.")
        comfy = comfy.replace(".attention.norm_k.", ".attention.k_norm.")
        if ".attention.to_q." in name:
            stem = name[: name.index(".attention.to_q.")]
            comfy = stem + ".attention.qkv.weight"
            layout[comfy] = tuple(stem + f".attention.to_{x}.weight" for x in "qkv")
        elif ".attention.to_k." not in name and ".attention.to_v." not in name:
            layout[comfy] = (name,)
    return layout


def without_dit_weights(base, folder):
    """A copy of the tiny folder whose transformer/ holds its config.json alone."""
    shutil.copytree(base, folder)
    (folder / "transformer" / WEIGHTS_FILE).unlink()
    return folder


def gguf_folder(base, root, name, dit_name="dit.gguf"):
    folder = without_dit_weights(base, root / name)
    return folder, folder / "transformer" / dit_name


def reference_folder(base, root, held):
    folder = without_dit_weights(base, root / "reference")
    tensors = {n: np.ascontiguousarray(v, np.float32) for n, v in held.items()}
    save_file(tensors, str(folder / "transformer" / WEIGHTS_FILE))
    return folder


def dequantized_model(model, folder):
    dit = model.dit
    plain = ZImageDiT(dit.config, dequantized_tree(dit.weights), dit.dtype)
    parts = LoadedParts(model.family, model.variant, plain, model.vae, model.encoder)
    return family.Z_IMAGE.build(folder, "plain", parts)


@pytest.mark.parametrize("naming", ["diffusers", "comfy"])
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_step_equals_the_dequantized_weights_networks(kind, naming, base, weights, rows, tmp_path):
    config = DiTConfig.from_dict(read_config(base / "transformer"))
    folder, path = gguf_folder(base, tmp_path, "gguf")
    layout = comfy_layout(config) if naming == "comfy" else None
    extra = {"norm_final.weight": np.ones(config.dim, np.float32)} if layout else {}
    if layout:
        layout["norm_final.weight"] = ("norm_final.weight",)
    held = write_dit(
        path,
        {**weights, **extra},
        types_for(kind, config),
        np.random.default_rng(int(kind)),
        prefix="model.diffusion_model." if layout else "",
        fused=layout,
        arch="lumina2",
    )
    held.pop("norm_final.weight", None)
    reference = reference_folder(base, tmp_path, held)
    model = family.Z_IMAGE.load(folder, "gguf")
    got, expected = step(model, rows), step(family.Z_IMAGE.load(reference, "reference"), rows)
    assert rel_l2(got, expected) <= TOLERANCE
    if kind not in (T.F32, T.F16, T.BF16):
        assert model.dit.weights["layers"][0]["qkv"].dtype == mx.uint8
    # the manifest names the diffusers tensors, q, k and v apart, with their logical shapes
    manifest = {t["name"]: t["shape"] for t in model.manifest()["tensors"]}
    assert manifest == {n: list(s) for n, s in tensor_shapes(config).items()}
    assert model.status()["quantization"]["dit"]["format"] == "gguf"


def test_the_comfy_layout_is_what_diffusers_converts(base):
    """The test's ComfyUI names are those diffusers' own single-file conversion reads."""
    config = DiTConfig.from_dict(read_config(base / "transformer"))
    layout = comfy_layout(config)
    checkpoint = {
        "model.diffusion_model." + name: torch.zeros(len(parts), 1)
        for name, parts in layout.items()
    }
    converted = convert_z_image_transformer_checkpoint_to_diffusers(checkpoint)
    assert set(converted) == set(tensor_shapes(config))


def test_a_quantize_setting_quantizes_the_files_float_layers(base, weights, rows, tmp_path):
    config = DiTConfig.from_dict(read_config(base / "transformer"))
    folder, path = gguf_folder(base, tmp_path, "gguf")
    types = {name: T.F16 for name in types_for(T.F16, config)}
    types["layers.0.attention.to_q.weight"] = T.Q8_0
    types["layers.0.attention.to_k.weight"] = T.Q8_0
    types["layers.0.attention.to_v.weight"] = T.Q8_0
    write_dit(path, weights, types, np.random.default_rng(1), arch="lumina2")
    model = family.Z_IMAGE.load(folder, "q", Quantization(4, 32))
    layers = model.dit.weights["layers"]
    assert BlockLayout.of(layers[0]["qkv" + LAYOUT]).types == (T.Q8_0,)  # as the file holds it
    assert layers[1]["qkv.quantization"] == (4, 32)  # an F16 weight, quantized at load
    assert rel_l2(step(model, rows), step(dequantized_model(model, folder), rows)) <= TOLERANCE


def test_a_file_of_the_wrong_shapes_is_refused_naming_it(base, tmp_path):
    wider = tmp_path / "wider"
    build_tiny_folder(
        wider, variant="turbo", **{**TRANSFORMER, "dim": 192, "n_heads": 4, "n_kv_heads": 4}
    )
    other = {n: np.array(v) for n, v in load_weights(wider / "transformer", mx.float32).items()}
    folder, path = gguf_folder(base, tmp_path, "wrong", "wide.gguf")
    write_dit(path, other, {}, np.random.default_rng(2), arch="lumina2")
    with pytest.raises(GGUFError, match=re.escape("wide.gguf: tensor ")):
        family.Z_IMAGE.check(folder)


def test_a_model_entrys_text_encoder_gguf_encodes_as_its_dequantized_weights(base, tmp_path):
    """A model entry's `text_encoder`: Qwen3 from a llama.cpp GGUF file (Q8_0, the tiny
    encoder's 32-wide inputs), encoding as the float encoder on gguf's dequantized weights."""
    from tests.encoders.qwen3.test_gguf import llama_cpp_name

    tensors, held = {}, {}
    rng = np.random.default_rng(4)
    for name, value in load_weights(base / "text_encoder", mx.float32).items():
        value = np.array(value)
        kind = T.Q8_0 if value.ndim == 2 else T.F32
        data = encoded(kind, value, rng)
        tensors[llama_cpp_name(name)] = (kind, data)
        held[name] = reference(kind, data).reshape(value.shape)
    path = write_gguf(tmp_path / "Qwen3-tiny-Q8_0.gguf", tensors, arch="qwen3")
    plain = tmp_path / "plain"
    shutil.copytree(base, plain)
    save_file(held, str(next((plain / "text_encoder").glob("*.safetensors"))))
    config = ServerConfig(host="127.0.0.1", port=0)
    config.models[base.name] = ModelSettings(text_encoder=path)
    registry = ModelRegistry([], base.name, extra_models=[base], settings=config.load_settings_for)
    server = serve(config, registry)
    try:
        status = server.call("GET", f"models/{base.name}/status").json()
        assert status["quantization"]["encoder"] == {
            "format": "gguf",
            "file": path.name,
            "types": {
                "F32": len(held) - sum(k == T.Q8_0 for k, _ in tensors.values()),
                "Q8_0": sum(k == T.Q8_0 for k, _ in tensors.values()),
            },
            "weights": "blocks",
            "bits_per_weight": 8.5,
        }
        assert server.post_json("models/load", {"model": base.name}).status_code == 200
        model = registry.loaded(base.name).model
        got = server.ctx.service.worker.call(lambda: model.encode("a red fox", [], False).cond)
        expected = family.Z_IMAGE.load(plain, "plain").encode("a red fox", [], refs=False).cond
        assert rel_l2(got, expected) <= TOLERANCE
        assert model.status()["quantization"]["encoder"]["types"]["Q8_0"] > 0
    finally:
        server.close()
