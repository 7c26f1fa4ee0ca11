"""Z-Image from ComfyUI's component files, with no diffusers folder (engine/components.py):
the tiny model's DiT in ComfyUI's NextDiT names under `model.diffusion_model.` (safetensors)
or as a GGUF file, its Qwen3 as one file (transformers' names, or llama.cpp's GGUF carrying
its tokenizer) and FLUX.1's VAE in ldm names, in a ComfyUI `models/` folder. The set's folder
holds configs told from the shapes, and serves the same encodes, steps and decodes as the
tiny diffusers folder, bit for bit; a set that does not fit is refused naming file and tensor
before anything loads."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gmlx_server.engine.components import ComponentError
from gmlx_server.engine.families.z_image import family
from gmlx_server.engine.families.z_image.layout import DiTConfig
from gmlx_server.engine.spec import read_config
from safetensors.numpy import save_file

from tests.engine.comfy_files import float32_weights, ldm_vae, write_gguf_text_encoder
from tests.engine.component_sets import assert_same_outputs, differing_keys, made_folder, outputs_of
from tests.engine.gguf_files import write_dit
from tests.families.z_image.test_gguf import comfy_layout
from tests.families.z_image.tiny.comfy import SET, write_comfy_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny diffusers folder, and ComfyUI's models/ folder holding the same weights."""
    return write_comfy_models(tmp_path_factory.mktemp("z_components"))


def test_the_configs_told_from_the_files_are_the_folders(tiny, tmp_path):
    folder, models = tiny
    made = SET.folder(models, tmp_path)
    # the RoPE tables' bounds and the tiny configs' extra keys are not read from files
    unread = {"axes_lens", "max_position_embeddings", "dtype", "architectures"}
    for component in ("transformer", "text_encoder", "vae"):
        assert differing_keys(made, folder, component) <= unread, component
    assert json.loads((made / "scheduler" / "scheduler_config.json").read_text())["shift"] == 3.0


def loaded(folder):
    return family.Z_IMAGE.load(folder, folder.name)


def outputs(model):
    return outputs_of(model, "a red boat on a lake", (16, 8, 8), 0.6, image=(64, 64))


@pytest.fixture(scope="module")
def expected(tiny):
    return outputs(loaded(tiny[0]))


@pytest.mark.parametrize("tokenizer", ["comfyui", "beside"])
def test_a_set_serves_what_the_folder_serves(tiny, expected, tmp_path, tokenizer):
    folder, models = tiny
    files = SET.files(models)
    if tokenizer == "beside":  # a tokenizer/ folder beside the DiT file, over ComfyUI's copy
        local = tmp_path / "local"
        local.mkdir()
        shutil.copy(files.dit, local / SET.dit)
        shutil.copytree(folder / "tokenizer", local / "tokenizer")
        files = SET.files(models, dit=local / SET.dit)
    made = made_folder(files, tmp_path)
    assert_same_outputs(outputs(loaded(made)), expected)


def test_sets_reading_one_tokenizer_source_share_the_tokenizer_built_from_it(tiny, tmp_path):
    """Two DiT files with ComfyUI's copy of Qwen's tokenizer: one tokenizer.json is built, and
    each set's tokenizer/ is it."""
    _, models = tiny
    other = tmp_path / "z_image_turbo_copy.safetensors"
    shutil.copy(SET.path(models, "dit"), other)
    first = SET.folder(models, tmp_path)
    second = SET.folder(models, tmp_path, dit=other)
    assert first != second
    assert (first / "tokenizer").resolve() == (second / "tokenizer").resolve()
    built = list((tmp_path / "sets").rglob("tokenizer.json"))
    assert len([p for p in built if not p.parent.is_symlink()]) == 1, built


def test_a_gguf_dit_in_comfyuis_names_serves_what_the_folder_serves(tiny, expected, tmp_path):
    """ComfyUI-GGUF's Z-Image file: NextDiT names, q/k/v fused, float32 here (the quantized
    types are tests/families/z_image/test_gguf.py's)."""
    folder, models = tiny
    weights = float32_weights(folder / "transformer")
    config = DiTConfig.from_dict(read_config(folder / "transformer"))
    path = tmp_path / "z_image_turbo-tiny-F32.gguf"
    write_dit(
        path, weights, {}, np.random.default_rng(0), fused=comfy_layout(config), arch="lumina2"
    )
    made = SET.folder(models, tmp_path, dit=path)
    assert_same_outputs(outputs(loaded(made)), expected)


def test_a_gguf_text_encoder_brings_its_tokenizer(tiny, expected, tmp_path):
    folder, models = tiny
    path = write_gguf_text_encoder(
        tmp_path / "Qwen3-tiny-F32.gguf",
        float32_weights(folder / "text_encoder"),
        folder / "tokenizer" / "tokenizer.json",
    )
    made = SET.folder(models, tmp_path, text_encoder=path, comfyui=None)
    got = loaded(made).encode("a red boat on a lake", [], refs=False).cond
    np.testing.assert_allclose(got, expected[0], rtol=0, atol=1e-5)


def test_the_variant_comes_from_the_name_or_the_entry(tiny, tmp_path):
    _, models = tiny
    plain = tmp_path / "z_image_tiny.safetensors"
    shutil.copy(SET.path(models, "dit"), plain)
    with pytest.raises(ComponentError, match="variant = one of 'turbo', 'base'"):
        SET.folder(models, tmp_path, dit=plain)
    made = SET.folder(models, tmp_path, dit=plain, variant="base")
    assert json.loads((made / "scheduler" / "scheduler_config.json").read_text())["shift"] == 6.0


def test_sets_that_do_not_fit_are_refused_naming_file_and_tensor(tiny, tmp_path):
    folder, models = tiny
    encoder = float32_weights(folder / "text_encoder")
    wide = {
        n: np.zeros(v.shape[:-1] + (64,), np.float32) if n.endswith("embed_tokens.weight") else v
        for n, v in encoder.items()
    }
    save_file(wide, str(tmp_path / "wide.safetensors"))
    with pytest.raises(ComponentError, match=r"cap_embedder\.1\.weight.*embed_tokens"):
        SET.folder(models, tmp_path, text_encoder=tmp_path / "wide.safetensors")
    vae = ldm_vae(float32_weights(folder / "vae"))
    vae["decoder.conv_in.weight"] = np.zeros((32, 8, 3, 3), np.float32)
    save_file(vae, str(tmp_path / "vae8.safetensors"))
    with pytest.raises(ComponentError, match=r"decoder\.conv_in\.weight takes 8 channels"):
        SET.folder(models, tmp_path, vae=tmp_path / "vae8.safetensors")
    cut = tmp_path / "z_image_turbo_cut.safetensors"
    cut.write_bytes((SET.path(models, "dit")).read_bytes()[:-100])
    with pytest.raises(ComponentError, match="cut short"):
        SET.folder(models, tmp_path, dit=cut)
    with pytest.raises(ComponentError, match="is not the DiT of a family"):
        SET.folder(models, tmp_path, dit=SET.path(models, "vae"))
    # the embedded tiny model's VAE: 16 channels, blocks of 8 groups where FLUX.1's has 32
    from gmlx_server.engine.families.z_image.embedded import ensure_embedded_model

    narrow = ensure_embedded_model() / "vae" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(ComponentError, match=r"not multiples of the 32 norm groups"):
        SET.folder(models, tmp_path, vae=narrow)
    whole = ldm_vae(float32_weights(folder / "vae"))
    decoder_only = {n: v for n, v in whole.items() if not n.startswith("encoder.")}
    save_file(decoder_only, str(tmp_path / "decoder_only.safetensors"))
    with pytest.raises(ComponentError, match=r"it has no encoder\.conv_in\.weight"):
        SET.folder(models, tmp_path, vae=tmp_path / "decoder_only.safetensors")
    # the text encoder and the VAE swapped: each has no tensor the other's test reads
    swapped = {"text_encoder": SET.path(models, "vae"), "vae": SET.path(models, "text_encoder")}
    with pytest.raises(ComponentError, match=r"; it has no embedding \(model\.embed_tokens"):
        SET.folder(models, tmp_path, **swapped)
    with pytest.raises(ComponentError, match=r"\(it has no decoder\.conv_in\.weight\)"):
        SET.folder(models, tmp_path, vae=SET.path(models, "text_encoder"))
