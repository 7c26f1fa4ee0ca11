"""Krea 2 from its component files, with no diffusers folder (engine/components.py): the tiny
model's DiT as one safetensors file in diffusers' names, its Qwen3-VL as one file (the
folder's transformers names, or llama.cpp's `qwen3vl` GGUF alone, no mmproj) and Qwen-Image's
VAE in Wan 2.1's names (ComfyUI's `qwen_image_vae.safetensors`), in a ComfyUI `models/`
folder. The set's folder holds configs told from the shapes and serves the same encodes,
steps and decodes as the diffusers folder, bit for bit (the GGUF encoder's within float
rounding); a set that does not fit is refused naming file and tensor."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gmlx_server.engine import components
from gmlx_server.engine.components import ComponentError
from gmlx_server.engine.encoders.qwen3 import files as qwen3_files
from gmlx_server.engine.families.krea2 import family
from gmlx_server.engine.families.krea2.spec import SELECT_LAYERS
from safetensors.numpy import save_file

from tests.engine.comfy_files import float32_weights, wan_vae, write_gguf_text_encoder
from tests.engine.component_sets import ComfySet, assert_same_outputs, differing_configs, outputs_of
from tests.engine.gguf_files import write_dit
from tests.families.krea2.tiny import build_tiny_folder

SET = ComfySet(
    dit="krea2_turbo_tiny.safetensors",
    text_encoder="qwen_3_vl_tiny.safetensors",
    vae="qwen_image_vae_tiny.safetensors",
)
PROMPT = "a red boat on a lake"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Krea 2 folder tapping the pipeline's own layers, and a ComfyUI models/ folder
    holding the same weights as single files."""
    root = tmp_path_factory.mktemp("krea2_components")
    folder = build_tiny_folder(
        root / "krea2-tiny", text_layers=max(SELECT_LAYERS) + 1, select_layers=SELECT_LAYERS
    )
    models = SET.write(
        root,
        dit=float32_weights(folder / "transformer"),
        text_encoder=float32_weights(folder / "text_encoder"),
        vae=wan_vae(float32_weights(folder / "vae")),
    )
    shutil.copytree(folder / "tokenizer", models / "text_encoders" / "tokenizer")
    return folder, models


def outputs(folder):
    return outputs_of(family.KREA2.load(folder, folder.name), PROMPT, (16, 6, 8), 0.6)


@pytest.fixture(scope="module")
def expected(tiny):
    return outputs(tiny[0])


def test_the_configs_told_from_the_files_are_the_folders(tiny, tmp_path):
    folder, models = tiny
    made = SET.folder(models, tmp_path)
    assert not differing_configs(made, folder)
    index = json.loads((made / "model_index.json").read_text())
    assert index["is_distilled"] is True  # "turbo" in the DiT file's name
    assert index["text_encoder_select_layers"] == list(SELECT_LAYERS)


def test_a_set_serves_what_the_folder_serves(tiny, expected, tmp_path):
    _, models = tiny
    made = SET.folder(models, tmp_path)
    assert_same_outputs(outputs(made), expected)


def test_a_gguf_dit_serves_what_the_folder_serves(tiny, expected, tmp_path):
    """A GGUF Krea 2 DiT keeps diffusers' names (ComfyUI-GGUF converts no Krea 2: no ComfyUI
    knows it), under ComfyUI's prefix; float32 here, the quantized types are test_gguf's."""
    folder, models = tiny
    path = tmp_path / "krea2_turbo-tiny-F32.gguf"
    weights = float32_weights(folder / "transformer")
    write_dit(
        path, weights, {}, np.random.default_rng(0), prefix="model.diffusion_model.", arch=None
    )
    made = SET.folder(models, tmp_path, dit=path)
    assert_same_outputs(outputs(made), expected)


def test_a_gguf_text_encoder_alone_serves_with_its_tokenizer(tiny, expected, tmp_path):
    folder, models = tiny
    weights = {
        "model." + n.removeprefix("language_model."): v
        for n, v in float32_weights(folder / "text_encoder").items()
        if n.startswith("language_model.")
    }
    path = write_gguf_text_encoder(
        tmp_path / "Qwen3-VL-tiny-F32.gguf",
        weights,
        folder / "tokenizer" / "tokenizer.json",
        arch="qwen3vl",
    )
    # Qwen3-VL's language model under llama.cpp's Qwen3 names is no Qwen3 (Z-Image's encoder)
    assert not qwen3_files.is_qwen3(components.header(path))
    assert qwen3_files.vl_width(components.header(path)) == 64
    made = SET.folder(models, tmp_path, text_encoder=path)
    model = family.KREA2.load(made, made.name)
    got = model.encode(PROMPT, [], refs=False).cond
    np.testing.assert_allclose(got, expected[0], rtol=0, atol=1e-5)


def test_sets_that_do_not_fit_are_refused_naming_file_and_tensor(tiny, tmp_path):
    folder, models = tiny
    z_image_vae = tmp_path / "ae.safetensors"
    save_file({"decoder.conv_in.weight": np.zeros((8, 4, 3, 3), np.float32)}, str(z_image_vae))
    with pytest.raises(ComponentError, match="not the 16-channel Qwen-Image VAE"):
        SET.folder(models, tmp_path, vae=z_image_vae)
    SET.assert_refuses_a_narrow_qwen3_vl(folder, models, tmp_path)
    plain = tmp_path / "krea2_tiny.safetensors"
    shutil.copy(SET.path(models, "dit"), plain)
    with pytest.raises(ComponentError, match="variant = one of 'turbo', 'raw'"):
        SET.folder(models, tmp_path, dit=plain)


def test_the_comfyui_folder_lists_the_set(tiny):
    _, models = tiny
    assert SET.listed_in(models)
