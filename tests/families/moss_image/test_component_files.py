"""MOSS-Image from its component files, with no diffusers folder (engine/components.py): the tiny
model's DiT as one safetensors file in upstream's names, its Qwen3.5 as llama.cpp's `qwen35`
GGUF file with the converter's metadata and tokens (tests/families/moss_image/
test_gguf_text_encoder.py), FLUX.2's VAE with the narrower decoder in ComfyUI's ldm names, in a
ComfyUI `models/` folder. The set's folder holds configs told from the shapes and the metadata,
and serves the same encodes, steps and decodes as the diffusers folder reading the same GGUF
file, bit for bit; a set that does not fit is refused naming file and tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gmlx_server.engine.components import ComponentError
from gmlx_server.engine.families.moss_image.family import MOSS_IMAGE
from gmlx_server.engine.spec import read_config
from safetensors.numpy import save_file

from tests.engine.comfy_files import float32_weights, ldm_vae
from tests.engine.component_sets import ComfySet, assert_same_outputs, differing_configs, outputs_of
from tests.families.moss_image.test_gguf_text_encoder import write_qwen35_gguf
from tests.families.moss_image.tiny import build_tiny_folder

SET = ComfySet(
    dit="moss_image_sft_tiny.safetensors",
    text_encoder="Qwen3.5-tiny-Q8_0.gguf",
    vae="moss_image_vae_tiny.safetensors",
)
PROMPT = "a neon sign that reads OPEN LATE"
# FLUX.2's VAE with the real group count (which its file cannot tell) and a narrower decoder
VAE = {
    "norm_num_groups": 32,
    "block_out_channels": [32, 64, 64, 64],
    "decoder_block_out_channels": [32, 32, 32, 32],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("moss_components")
    folder = build_tiny_folder(root / "moss-tiny", **VAE)
    models = SET.write(
        root,
        dit=float32_weights(folder / "transformer"),
        vae=ldm_vae(float32_weights(folder / "vae")),
    )
    write_qwen35_gguf(folder, SET.path(models, "text_encoder"), metadata=True)
    return folder, models


def outputs(folder, **files):
    """The folder's encode, a step leaving out block 22 (the negative pass's), a decode and an
    encode (`files`: the load's component files)."""
    model = MOSS_IMAGE.load(folder, folder.name, **files)
    return outputs_of(model, PROMPT, (128, 3, 4), 600.0, skip=(22,))


def test_the_configs_told_from_the_files_are_the_folders(tiny, tmp_path):
    folder, models = tiny
    made = SET.folder(models, tmp_path)
    assert not differing_configs(made, folder)
    assert (
        read_config(made / "vae")["decoder_block_out_channels"] == VAE["decoder_block_out_channels"]
    )
    assert json.loads((made / "model_index.json").read_text())["_class_name"] == "MOSSImagePipeline"
    assert MOSS_IMAGE.spec.identify(made) == ("moss_image", "sft")


def test_a_set_serves_what_the_folder_serves_with_that_gguf(tiny, tmp_path):
    folder, models = tiny
    made = SET.folder(models, tmp_path)
    expected = outputs(folder, text_encoder=SET.path(models, "text_encoder"))
    assert_same_outputs(outputs(made), expected)


def test_sets_that_do_not_fit_are_refused_naming_file_and_tensor(tiny, tmp_path):
    folder, models = tiny
    safetensors = tmp_path / "qwen_3.5_tiny.safetensors"
    save_file(float32_weights(folder / "text_encoder"), str(safetensors))
    with pytest.raises(ComponentError, match="not llama.cpp's Qwen3.5 text encoder 32 wide"):
        SET.folder(models, tmp_path, text_encoder=safetensors)
    z_image_vae = tmp_path / "ae.safetensors"
    save_file({"decoder.conv_in.weight": np.zeros((8, 16, 3, 3), np.float32)}, str(z_image_vae))
    with pytest.raises(ComponentError, match="not FLUX.2's 32-channel autoencoder"):
        SET.folder(models, tmp_path, vae=z_image_vae)


def test_the_comfyui_folder_lists_the_set(tiny):
    _, models = tiny
    assert SET.listed_in(models)
