"""FLUX.3 klein from its component files, with no diffusers folder (engine/components.py): the
tiny model's DiT as one file in BFL's names (tests/families/flux3_klein/bfl.py, the inverse of
diffusers' single-file conversion) or diffusers', its Qwen3-VL as one file, FLUX.2's VAE in
ComfyUI's ldm names, in a ComfyUI `models/` folder. The set's folder holds configs told from the
shapes and serves the same encodes, steps and decodes as the diffusers folder, bit for bit; a
set that does not fit is refused naming file and tensor."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gmlx_server.engine.components import ComponentError
from gmlx_server.engine.families.flux3_klein import family
from gmlx_server.engine.families.flux3_klein.spec import OUT_LAYERS
from safetensors.numpy import save_file

from tests.engine.comfy_files import float32_weights, ldm_vae
from tests.engine.component_sets import ComfySet, assert_same_outputs, differing_configs, outputs_of
from tests.families.flux2_klein.tiny.vae import build_vae
from tests.families.flux3_klein.bfl import bfl_state_dict
from tests.families.flux3_klein.tiny import build_tiny_folder

SET = ComfySet(
    dit="flux-3-klein-tiny.safetensors",
    text_encoder="qwen_3_vl_tiny.safetensors",
    vae="flux2-vae-tiny.safetensors",
)
PROMPT = "a red boat on a lake"
# FLUX.2's VAE with the real group count, which its file cannot tell (vaes/from_files.py's facts)
VAE = {"norm_num_groups": 32, "block_out_channels": (32, 32, 32, 32)}


@pytest.fixture(scope="module", params=["distilled", "base"])
def tiny(request, tmp_path_factory):
    """A tiny FLUX.3 klein folder tapping the pipelines' own layers, and a ComfyUI models/
    folder holding the same weights as single files (the DiT in BFL's names)."""
    root = tmp_path_factory.mktemp(f"flux3_components_{request.param}")
    folder = build_tiny_folder(
        root / "flux3-tiny",
        variant=request.param,
        text_layers=max(OUT_LAYERS) + 1,
        out_layers=OUT_LAYERS,
    )
    build_vae(folder / "vae", seed=0, **VAE)
    models = SET.write(
        root,
        dit=bfl_state_dict(float32_weights(folder / "transformer")),
        text_encoder=float32_weights(folder / "text_encoder"),
        vae=ldm_vae(float32_weights(folder / "vae")),
    )
    shutil.copytree(folder / "tokenizer", models / "text_encoders" / "tokenizer")
    return folder, models, request.param


def outputs(folder):
    """The folder's encode, a flow-map step along a schedule, a decode and an encode."""
    model = family.FLUX3_KLEIN.load(folder, folder.name)
    schedule = np.float32([1.0, 0.6, 0.0])
    return outputs_of(model, PROMPT, (128, 3, 4), 0.6, sample_sigmas=schedule)


@pytest.fixture(scope="module")
def expected(tiny):
    return outputs(tiny[0])


def test_the_configs_told_from_the_files_are_the_folders(tiny, tmp_path):
    folder, models, variant = tiny
    made = SET.folder(models, tmp_path)
    assert not differing_configs(made, folder)
    index = json.loads((made / "model_index.json").read_text())
    assert index["text_encoder_out_layers"] == list(OUT_LAYERS)
    assert family.FLUX3_KLEIN.spec.identify(made) == ("flux3_klein", variant)  # by the flow map


def test_a_set_serves_what_the_folder_serves(tiny, expected, tmp_path):
    _, models, _ = tiny
    made = SET.folder(models, tmp_path)
    assert_same_outputs(outputs(made), expected)


def test_a_dit_in_diffusers_names_serves_the_same(tiny, expected, tmp_path):
    folder, models, _ = tiny
    path = tmp_path / "flux3_diffusers.safetensors"
    weights = float32_weights(folder / "transformer")
    save_file({"model.diffusion_model." + n: v for n, v in weights.items()}, str(path))
    made = SET.folder(models, tmp_path, dit=path)
    assert_same_outputs(outputs(made), expected)


def test_sets_that_do_not_fit_are_refused_naming_file_and_tensor(tiny, tmp_path):
    folder, models, _ = tiny
    z_image_vae = tmp_path / "ae.safetensors"
    save_file({"decoder.conv_in.weight": np.zeros((8, 16, 3, 3), np.float32)}, str(z_image_vae))
    with pytest.raises(ComponentError, match="not FLUX.2's 32-channel autoencoder"):
        SET.folder(models, tmp_path, vae=z_image_vae)
    SET.assert_refuses_a_narrow_qwen3_vl(folder, models, tmp_path)


def test_the_comfyui_folder_lists_the_set(tiny):
    _, models, _ = tiny
    assert SET.listed_in(models)
