"""FLUX.2 klein from ComfyUI's component files, with no diffusers folder (engine/components.py):
the tiny 4B's DiT in BFL's names under `model.diffusion_model.` (safetensors) or as a GGUF
file, its Qwen3 as one file and FLUX.2's VAE in ldm names with its batch norm, in a ComfyUI
`models/` folder. The set serves the same encodes, steps (with a reference) and decodes as the
tiny diffusers folder, bit for bit; the KV family is named by the entry; a set that does not
fit is refused naming file and tensor."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_contract.hashing import tensor_hash
from gmlx_server.engine import components
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.components import ComponentError
from gmlx_server.engine.families.flux2_klein import family
from gmlx_server.engine.spec import model_index, read_config
from safetensors.numpy import save_file

from tests.engine.comfy_files import float32_weights, ldm_vae, write_comfy_tokenizer
from tests.engine.component_sets import ComfySet, assert_same_outputs, made_folder
from tests.families.flux2_klein.test_gguf import write_file
from tests.families.flux2_klein.tiny.bfl import bfl_state_dict
from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.families.flux2_klein.tiny.vae import build_vae

VAE = {"norm_num_groups": 32, "block_out_channels": (32, 32, 32, 32)}
SET = ComfySet(
    dit="flux-2-klein-tiny.safetensors",
    text_encoder="qwen_3_tiny.safetensors",
    vae="flux2-vae-tiny.safetensors",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("klein_components")
    folder = root / "klein-tiny"
    build_tiny_folder(folder, "flux2_klein", num_single_layers=1)
    shutil.rmtree(folder / "vae")
    build_vae(folder / "vae", seed=0, **VAE)
    bfl = bfl_state_dict(float32_weights(folder / "transformer"))
    models = SET.write(
        root,
        dit={"model.diffusion_model." + n: np.ascontiguousarray(v) for n, v in bfl.items()},
        vae=ldm_vae(float32_weights(folder / "vae")),
    )
    encoder = next((folder / "text_encoder").glob("*.safetensors"))
    shutil.copy(encoder, SET.path(models, "text_encoder"))
    write_comfy_tokenizer(
        folder / "tokenizer" / "tokenizer.json", models.parent / components.COMFY_QWEN_TOKENIZER
    )
    return folder, models


def outputs(model):
    cond = model.encode("a red boat on a lake", [], refs=False).cond[0]
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((128, 2, 2)).astype(np.float32)
    row = StepRow(
        cond=cond,
        cond_key="wire:" + tensor_hash(cond[None]),
        ref_latents=(ref,),
        ref_keys=(tensor_hash(ref),),
    )
    x = rng.standard_normal((1, 128, 3, 4)).astype(np.float32)
    step = model.denoise_step(x, np.array([0.6], np.float32), [row]).out
    decoded = model.vae_decode(rng.standard_normal((128, 2, 2)).astype(np.float32), alpha=False)
    encoded = model.vae_encode(rng.random((32, 32, 3)).astype(np.float32))
    return cond, step, decoded, encoded


@pytest.fixture(scope="module")
def expected(tiny):
    return outputs(family.FLUX2_KLEIN.load(tiny[0], "folder"))


def test_the_configs_told_from_the_files_are_the_folders(tiny, tmp_path):
    folder, models = tiny
    made = SET.folder(models, tmp_path)
    assert family.FLUX2_KLEIN.spec.identify(made) == ("flux2_klein", "distilled")
    for component in ("transformer", "vae"):
        told, written = read_config(made / component), read_config(folder / component)
        for key, value in told.items():
            if key in written and not key.startswith("_"):
                assert list(np.atleast_1d(value)) == list(np.atleast_1d(written[key])), (
                    component,
                    key,
                )


@pytest.mark.parametrize("dit", ["safetensors", "gguf"])
def test_a_set_serves_what_the_folder_serves(tiny, expected, tmp_path, dit):
    folder, models = tiny
    files = SET.files(models)
    if dit == "gguf":  # BFL's names as a float GGUF file (ComfyUI-GGUF's flux architecture)
        weights = float32_weights(folder / "transformer")
        path = tmp_path / "flux-2-klein-tiny-F32.gguf"
        write_file(path, weights, dict.fromkeys(weights, T.F32), seed=0)
        files = SET.files(models, dit=path)
    made = made_folder(files, tmp_path)
    assert_same_outputs(outputs(family.FLUX2_KLEIN.load(made, "set")), expected)


def test_the_kv_family_and_the_base_variant_are_named(tiny, tmp_path):
    _, models = tiny
    base = tmp_path / "flux-2-klein-base-tiny.safetensors"
    shutil.copy(SET.path(models, "dit"), base)
    made = SET.folder(models, tmp_path, dit=base)
    assert family.FLUX2_KLEIN.spec.identify(made) == ("flux2_klein", "base")
    made = SET.folder(models, tmp_path, family="flux2_klein_9b_kv")
    assert model_index(made)["_class_name"] == "Flux2KleinKVPipeline"
    with pytest.raises(ComponentError, match="not a Z-Image DiT"):
        SET.folder(models, tmp_path, family="z_image")


def test_sets_that_do_not_fit_are_refused_naming_file_and_tensor(tiny, tmp_path):
    folder, models = tiny
    vae = ldm_vae(float32_weights(folder / "vae"))
    del vae["bn.running_mean"]
    save_file(vae, str(tmp_path / "ae.safetensors"))
    with pytest.raises(ComponentError, match="has no bn.running_mean"):
        SET.folder(models, tmp_path, vae=tmp_path / "ae.safetensors")
    encoder = float32_weights(folder / "text_encoder")
    short = {
        n: v
        for n, v in encoder.items()
        if not n.startswith(("model.layers.26.", "model.layers.27."))
    }
    save_file(short, str(tmp_path / "short.safetensors"))
    with pytest.raises(
        ComponentError, match="has 26 decoder layers; FLUX.2 klein reads the first 27"
    ):
        SET.folder(models, tmp_path, text_encoder=tmp_path / "short.safetensors")
    wide = {**encoder, "model.embed_tokens.weight": np.zeros((8, 64), np.float32)}
    save_file(wide, str(tmp_path / "wide.safetensors"))
    with pytest.raises(ComponentError, match=r"txt_in\.weight reads 3 layers of 32.*embed_tokens"):
        SET.folder(models, tmp_path, text_encoder=tmp_path / "wide.safetensors")
