"""FLUX.2 klein's DiT from a GGUF file in BFL's naming, as ComfyUI-GGUF's convert script writes
it from BFL's checkpoint (`general.architecture` "flux", the names as they are, no reshapes),
and in diffusers' naming: the forward equals diffusers' Flux2Transformer2DModel holding the
weights `gguf.quants.dequantize` gives, converted by diffusers' own single-file conversion
(relative L2 <= 1e-4; the types with no exact MLX form equal their own dequantized weights'
network), for every type the server reads, the final modulation's swapped halves quantized
too; a file of another model or of the wrong shapes is refused naming it."""

from __future__ import annotations

import re

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.loaders.single_file_utils import (
    convert_flux2_transformer_checkpoint_to_diffusers,
)
from gguf import GGMLQuantizationType as T
from gmlx_server.engine.families.flux2_klein import family
from gmlx_server.engine.families.flux2_klein.dit import Flux2DiT, dit_file
from gmlx_server.engine.ggml_blocks import LAYOUT, BlockLayout
from gmlx_server.engine.gguf import READABLE, GGUFError
from gmlx_server.engine.precision import Quantization

from tests.compare import rel_l2
from tests.engine.gguf_files import encoded, reference, write_gguf
from tests.engine.quantized import dequantized_tree
from tests.families.flux2_klein.reference import reference_dit
from tests.families.flux2_klein.tiny.bfl import bfl_state_dict
from tests.families.flux2_klein.tiny.transformer import build_transformer, tiny_config

TOLERANCE = 1e-4
# Width 256 (2 heads of 128): the blocks' and modulations' inputs (256, 768, 1024) take a
# K-quant's 256-blocks; the embedders' (128, 96) a 32-block type.
WIDE = {"num_attention_heads": 2, "attention_head_dim": 128, "axes_dims_rope": (32, 32, 32, 32)}
TYPES = list(READABLE)
ARCH = "flux"  # ComfyUI-GGUF's convert script detects BFL's FLUX checkpoints, FLUX.2 too, so


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    """The wide tiny transformer's folder (config.json and diffusers weights) and its float32
    state dict."""
    folder = tmp_path_factory.mktemp("flux2_gguf") / "transformer"
    model = build_transformer(folder, seed=0, **WIDE)
    return folder, {name: value.detach().numpy() for name, value in model.state_dict().items()}


def types_for(kind: T, weights: dict[str, np.ndarray]) -> dict[str, T]:
    """`kind` for every matrix whose input its blocks divide (else Q8_0), F32 for the rest."""
    block = gguf.GGML_QUANT_SIZES[kind][0]
    types = {}
    for name, value in weights.items():
        if value.ndim != 2:
            types[name] = T.F32
        else:
            types[name] = kind if value.shape[1] % block == 0 else T.Q8_0
    return types


def write_file(path, weights, types, seed, prefix="", arch=ARCH) -> dict[str, np.ndarray]:
    """A GGUF file of `weights` (by their names in the file), each tensor of its type, the
    names under `prefix`; what it holds, as gguf dequantizes it."""
    rng = np.random.default_rng(seed)
    tensors, held = {}, {}
    for name, value in weights.items():
        data = encoded(types[name], value, rng)
        tensors[prefix + name] = (types[name], data)
        held[name] = reference(types[name], data).reshape(value.shape)
    write_gguf(path, tensors, arch=arch)
    return held


def diffusers_model(bfl: dict[str, np.ndarray]) -> Flux2Transformer2DModel:
    """The diffusers transformer holding BFL-named weights, converted by diffusers itself."""
    state = {name: torch.from_numpy(np.array(value)) for name, value in bfl.items()}
    model = Flux2Transformer2DModel(**tiny_config(**WIDE))
    model.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(state))
    return model.eval()


def inputs(seed: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 128, 3, 4)).astype(np.float32)
    cap = rng.standard_normal((1, 7, 96)).astype(np.float32)
    refs = [rng.standard_normal((128, 2, 3)).astype(np.float32)]
    return x, cap, refs


def forward(dit: Flux2DiT, x, cap, refs) -> np.ndarray:
    refs = [[mx.array(r) for r in refs]]
    t = mx.array([0.45], mx.float32)
    return np.array(dit.forward(mx.array(x), t, [mx.array(cap[0])], refs))


@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_a_bfl_file_steps_as_diffusers_on_the_dequantized_weights(kind, transformer, tmp_path):
    folder, weights = transformer
    bfl = bfl_state_dict(weights)
    path = tmp_path / f"flux-2-klein-tiny-{kind.name}.gguf"
    held = write_file(path, bfl, types_for(kind, bfl), int(kind))
    dit = Flux2DiT.load(folder, mx.float32, dit=path)
    x, cap, refs = inputs()
    got = forward(dit, x, cap, refs)
    expected = reference_dit(diffusers_model(held), x, [0.45], cap, refs)
    assert rel_l2(got, expected) <= TOLERANCE
    if kind not in (T.F32, T.F16, T.BF16):  # kept quantized as the file holds them
        assert dit.weights["double"][0]["img_qkv"].dtype == mx.uint8
        assert dit.weights["single"][1]["qkv_mlp"].dtype == mx.uint8
        assert dit.weights["final_mod"].dtype == mx.uint8  # its halves swapped as rows


def test_a_comfyui_q4_k_m_mix_under_its_prefix(transformer, tmp_path):
    """As ComfyUI-GGUF quantizes a FLUX checkpoint at Q4_K_M: the blocks' and modulations'
    matrices Q4_K, the fused qkv Q5_K, the MLPs' output Q6_K, the embedders and the final
    layer F16, the vectors F32; the names under `model.diffusion_model.`."""
    folder, weights = transformer
    bfl = bfl_state_dict(weights)
    types = {}
    for name, value in bfl.items():
        if value.ndim == 1:
            types[name] = T.F32
        elif name.startswith(("img_in.", "txt_in.", "time_in.", "final_layer.")):
            types[name] = T.F16
        elif ".qkv." in name:
            types[name] = T.Q5_K
        elif name.endswith("_mlp.2.weight"):
            types[name] = T.Q6_K
        else:
            types[name] = T.Q4_K
    path = tmp_path / "flux-2-klein-tiny-Q4_K_M.gguf"
    held = write_file(path, bfl, types, 7, prefix="model.diffusion_model.")
    dit = Flux2DiT.load(folder, mx.float32, dit=path)
    plain = Flux2DiT(dit.config, dequantized_tree(dit.weights), mx.float32)
    x, cap, refs = inputs(4)
    got = forward(dit, x, cap, refs)
    assert rel_l2(got, forward(plain, x, cap, refs)) <= TOLERANCE
    expected = reference_dit(diffusers_model(held), x, [0.45], cap, refs)
    assert rel_l2(got, expected) <= TOLERANCE  # the Q6_K parts too: held as the file's blocks
    double = dit.weights["double"][0]
    assert BlockLayout.of(double["img_qkv" + LAYOUT]).types == (T.Q5_K,)
    assert BlockLayout.of(double["img_ff_out" + LAYOUT]).types == (T.Q6_K,)
    # F16 in the file: held as stored, widened to float32 as it runs
    assert BlockLayout.of(dit.weights["final_mod" + LAYOUT]).types == (T.F16,)
    status = dit_file(folder, path).status()
    assert status["format"] == "gguf" and status["types"]["Q4_K"] > 0


def test_a_diffusers_named_file_reads_the_same(transformer, tmp_path):
    """A GGUF file under diffusers' own names (no swap, q/k/v apart) is read as well."""
    folder, weights = transformer
    path = tmp_path / "diffusers-Q8_0.gguf"
    held = write_file(path, weights, types_for(T.Q8_0, weights), 5)
    dit = Flux2DiT.load(folder, mx.float32, dit=path)
    x, cap, refs = inputs(5)
    expected = reference_dit(diffusers_model(bfl_state_dict(held)), x, [0.45], cap, refs)
    assert rel_l2(forward(dit, x, cap, refs), expected) <= TOLERANCE


def test_a_quantize_setting_quantizes_the_files_float_layers(transformer, tmp_path):
    folder, weights = transformer
    bfl = bfl_state_dict(weights)
    types = {name: T.F16 if value.ndim == 2 else T.F32 for name, value in bfl.items()}
    types["double_blocks.0.img_attn.qkv.weight"] = T.Q8_0
    path = tmp_path / "mixed.gguf"
    write_file(path, bfl, types, 6)
    dit = Flux2DiT.load(folder, mx.float32, Quantization(4, 32), dit=path)
    blocks = dit.weights["double"]
    assert BlockLayout.of(blocks[0]["img_qkv" + LAYOUT]).types == (T.Q8_0,)  # as the file holds it
    assert blocks[1]["img_qkv.quantization"] == (4, 32)  # an F16 weight, quantized at load
    assert "x_in.quantization" not in dit.weights  # the embedders stay float
    plain = Flux2DiT(dit.config, dequantized_tree(dit.weights), mx.float32)
    x, cap, refs = inputs(6)
    assert rel_l2(forward(dit, x, cap, refs), forward(plain, x, cap, refs)) <= TOLERANCE


def transformer_folder(tmp_path, transformer):
    """A model folder whose family check reads `transformer`'s config (the check reads no
    other component)."""
    import json
    import shutil

    from gmlx_server.engine.families.flux2_klein.spec import model_index_of

    root = tmp_path / "klein"
    shutil.copytree(transformer[0], root / "transformer")
    (root / "model_index.json").write_text(json.dumps(model_index_of("flux2_klein", "distilled")))
    return root


def test_files_of_another_model_or_shape_are_refused_naming_them(transformer, tmp_path):
    folder, weights = transformer
    root = transformer_folder(tmp_path, transformer)
    bfl = bfl_state_dict(weights)
    cases = []
    other = tmp_path / "z-image.gguf"  # a Z-Image file (ComfyUI's Lumina2 names)
    write_file(
        other,
        {"layers.0.attention.qkv.weight": np.zeros((96, 32), np.float32)},
        {"layers.0.attention.qkv.weight": T.F16},
        1,
        arch="lumina2",
    )
    cases.append(
        (
            other,
            "z-image.gguf is not a FLUX.2 klein DiT (its architecture: lumina2): it has no tensor ",
        )
    )
    missing = tmp_path / "missing.gguf"
    partial = {n: v for n, v in bfl.items() if n != "single_blocks.1.linear2.weight"}
    write_file(missing, partial, types_for(T.Q8_0, partial), 2)
    cases.append((missing, "it has no tensor single_transformer_blocks.1.attn.to_out.weight"))
    wrong = tmp_path / "wrong.gguf"
    narrow = {n: v[: v.shape[0] // 2] if n == "img_in.weight" else v for n, v in bfl.items()}
    write_file(wrong, narrow, types_for(T.Q8_0, narrow), 3)
    cases.append((wrong, "wrong.gguf: tensor img_in.weight has shape [128, 128]"))
    for path, message in cases:
        with pytest.raises(GGUFError, match=re.escape(message)):
            family.FLUX2_KLEIN.check(root, dit=path)
