"""The pack reads a family's facts from the server's status; its tables serve older servers."""

import json

import pytest
from gmlx_comfy.clip import prompt_text
from gmlx_comfy.families import (
    COMFY_BASE_CLASSES,
    PACK_BUILT_CLASSES,
    empty_prompt,
    latent_normalisation,
    ref_method,
)


def test_the_reference_method_is_the_status_s_else_the_table_s():
    published = {"family": "qwen_image21", "conditioning": {"ref_method": "offset"}}
    assert ref_method(published) == "offset"
    assert ref_method({"family": "qwen_image21"}) == "index"  # an older server
    assert ref_method({"family": "someone_new"}) is None


def test_the_empty_prompt_is_the_status_s_else_the_table_s():
    assert empty_prompt("someone_new", "<empty>") == "<empty>"
    assert empty_prompt("qwen_image21", "") == ""  # the server's word wins
    assert empty_prompt("qwen_image21") == " " and empty_prompt("z_image") == ""
    assert prompt_text("", "someone_new", "<empty>") == "<empty>"
    assert prompt_text("a cat", "someone_new", "<empty>") == "a cat"


def test_the_server_publishes_what_the_tables_hold_for_its_family():
    family = pytest.importorskip("gmlx_server.engine.families.qwen_image21.family")
    embedded = pytest.importorskip("gmlx_server.engine.families.qwen_image21.embedded")
    status = {
        "family": "qwen_image21",
        **family.QWEN_IMAGE21.describe(embedded.ensure_embedded_model()),
    }
    assert ref_method(status) == ref_method({"family": "qwen_image21"})
    assert empty_prompt("qwen_image21", status["conditioning"]["empty_prompt"]) == (
        empty_prompt("qwen_image21")
    )


def test_z_image_is_a_pack_built_class_on_comfy_s_lumina2_where_comfy_knows_it():
    assert PACK_BUILT_CLASSES["ZImage"] == "z_image"
    assert COMFY_BASE_CLASSES["ZImage"] == "Lumina2"
    assert "QwenImage21" not in COMFY_BASE_CLASSES  # the pack's class alone


def test_z_image_s_status_gives_the_flux_vae_s_normalisation(tmp_path):
    """The status publishes shift_factor / 1 / scaling_factor per channel; the pack's latent
    format reads them as (z - mean) / std, which is ComfyUI's own Flux process_in."""
    family = pytest.importorskip("gmlx_server.engine.families.z_image.family")
    folder = pytest.importorskip("tests.families.z_image.tiny.folder")
    folder.build_tiny_folder(tmp_path)
    status = {"family": "z_image", **family.Z_IMAGE.describe(tmp_path)}
    assert status["comfy"]["model_class"] in PACK_BUILT_CLASSES
    vae = json.loads((tmp_path / "vae" / "config.json").read_text())
    mean, std = latent_normalisation(status)
    assert len(mean) == len(std) == status["latent"]["channels"] == 16
    assert mean == [vae["shift_factor"]] * 16
    assert std == pytest.approx([1 / vae["scaling_factor"]] * 16)
    assert ref_method(status) is None
    assert empty_prompt("z_image", status["conditioning"]["empty_prompt"]) == ""


def test_flux2_klein_is_a_pack_built_class_in_model_space(tmp_path):
    """FLUX.2 klein's status: ComfyUI's Flux2 class (0.33 has it), references by index, an empty
    prompt as it is, and VAE routes in model space, so the pack's latent format is the
    identity."""
    family = pytest.importorskip("gmlx_server.engine.families.flux2_klein.family")
    folder = pytest.importorskip("tests.families.flux2_klein.tiny.folder")
    folder.build_tiny_folder(tmp_path, num_single_layers=1)
    status = {"family": "flux2_klein", **family.FLUX2_KLEIN.describe(tmp_path)}
    assert PACK_BUILT_CLASSES[status["comfy"]["model_class"]] == "flux2_klein"
    assert COMFY_BASE_CLASSES["Flux2"] == "Flux2"
    assert latent_normalisation(status) is None
    assert ref_method(status) == "index"  # published: no older server served klein
    assert ref_method({"family": "flux2_klein"}) is None
    assert empty_prompt("flux2_klein", status["conditioning"]["empty_prompt"]) == ""
