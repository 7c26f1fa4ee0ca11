"""The example workflows open in ComfyUI's template browser and run as shipped: each UI file is
a consistent UI-format graph of known node types that names the server's default model, has a
thumbnail, and converts to its API copy (which the e2e suite queues on a real ComfyUI)."""

from __future__ import annotations

import importlib
import runpy
import sys
import uuid
from pathlib import Path

import pytest
from gmlx_server.engine.spec import family_specs

from tests.comfy.workflow_files import (
    API_DIR,
    DEFAULT_MODEL_NAMES,
    EMBEDDED_FAMILY,
    FRONTEND_NODES,
    NAME_PREFIX,
    NAMES,
    NOTED_FAMILY,
    PACK_DIR,
    STOCK_NODES,
    UI_DIR,
    api_workflow,
    ui_to_api,
    ui_workflow,
    widget_inputs,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the dev environment is 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# The folders whose *.json ComfyUI lists as a custom node's templates (app/custom_node_manager.py).
TEMPLATE_FOLDERS = ("example_workflows", "example", "examples", "workflow", "workflows")
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
MAX_THUMBNAIL_BYTES = 100_000


def _pack_nodes() -> dict:
    from gmlx_comfy.nodes import NODE_CLASS_MAPPINGS

    return NODE_CLASS_MAPPINGS


def test_the_template_folder_holds_exactly_the_ui_files_and_their_thumbnails():
    assert sorted(p.name for p in UI_DIR.iterdir()) == sorted(
        f"{name}{ext}" for name in NAMES for ext in (".json", ".jpg")
    )
    assert sorted(p.stem for p in API_DIR.glob("*.json")) == sorted(NAMES)
    for folder in TEMPLATE_FOLDERS[1:]:
        assert not (PACK_DIR / folder).exists(), f"ComfyUI would list {folder}/*.json"


def test_each_example_has_its_own_workflow_id():
    """The frontend keys an open workflow by this id."""
    ids = [uuid.UUID(ui_workflow(name)["id"]) for name in NAMES]
    assert len(set(ids)) == len(ids) and uuid.UUID(int=0) not in ids


def test_example_names_carry_the_packs_prefix():
    assert all(name.startswith(NAME_PREFIX) for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_thumbnail_is_a_small_jpeg(name):
    from PIL import Image

    path = UI_DIR / f"{name}.jpg"
    assert path.stat().st_size <= MAX_THUMBNAIL_BYTES
    with Image.open(path) as image:
        assert image.format == "JPEG"


@pytest.mark.parametrize("name", NAMES)
def test_ui_file_is_a_consistent_ui_workflow(name):
    ui = ui_workflow(name)
    assert isinstance(ui["version"], (int, float))
    nodes = {node["id"]: node for node in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]), "node ids repeat"
    assert ui["last_node_id"] >= max(nodes)
    links = {link[0]: link for link in ui["links"]}
    assert len(links) == len(ui["links"]), "link ids repeat"
    assert ui["last_link_id"] >= max(links)

    for link_id, origin, origin_slot, target, target_slot, kind in ui["links"]:
        output = nodes[origin]["outputs"][origin_slot]
        target_input = nodes[target]["inputs"][target_slot]
        assert link_id in output["links"] and output["type"] == kind
        assert target_input["link"] == link_id and target_input["type"] == kind
    for node in ui["nodes"]:
        for slot, target_input in enumerate(node.get("inputs", [])):
            if target_input.get("link") is not None:
                assert links[target_input["link"]][3:5] == [node["id"], slot]
        for slot, output in enumerate(node.get("outputs", [])):
            for link_id in output.get("links") or []:
                assert links[link_id][1:3] == [node["id"], slot]


@pytest.mark.parametrize("name", NAMES)
def test_every_node_type_is_the_packs_or_stock_comfyuis(name):
    known = set(_pack_nodes()) | STOCK_NODES | FRONTEND_NODES
    unknown = {node["type"] for node in ui_workflow(name)["nodes"]} - known
    assert not unknown


@pytest.mark.parametrize("name", NAMES)
def test_pack_nodes_carry_their_widgets_in_input_order(name, monkeypatch):
    """Widget values follow the order of the node's own widget inputs, which the frontend
    reads from INPUT_TYPES."""
    from gmlx_comfy import nodes as pack

    monkeypatch.setattr(pack.MODEL_LIST, "names", lambda settings=None: ["any"])
    for node in ui_workflow(name)["nodes"]:
        if node["type"] not in _pack_nodes():
            continue
        declared = _pack_nodes()[node["type"]].INPUT_TYPES()
        widgets = [
            input_name
            for section in ("required", "optional")
            for input_name, spec in declared.get(section, {}).items()
            if isinstance(spec[0], list) or spec[0] in WIDGET_TYPES
        ]
        assert [s["widget"]["name"] for s in node["inputs"] if "widget" in s] == widgets
        assert len(node.get("widgets_values") or []) == len(widgets)


def _models_named(name: str) -> tuple[set, set]:
    """The model names of an example's loaders: in its API copy, and in its UI file."""
    api = {
        node["inputs"]["model_name"]
        for node in api_workflow(name).values()
        if "model_name" in node["inputs"]
    }
    ui = {
        widget_inputs(node)["model_name"]
        for node in ui_workflow(name)["nodes"]
        if node["type"] not in FRONTEND_NODES and "model_name" in widget_inputs(node)
    }
    return api, ui


@pytest.mark.parametrize("name", DEFAULT_MODEL_NAMES)
def test_workflow_names_an_embedded_model(name):
    """The default server's model, or, in a Z-Image or Krea 2 example, that family's embedded
    model."""
    family = EMBEDDED_FAMILY.get(name, "qwen_image21")
    expected = importlib.import_module(f"gmlx_server.engine.families.{family}.embedded").MODEL_NAME
    assert _models_named(name) == ({expected}, {expected})


@pytest.mark.parametrize("name", sorted(NOTED_FAMILY))
def test_a_noted_example_names_its_embedded_model_and_says_how_to_use_a_real_one(name):
    """The loaders name the family's embedded model (so the example runs on a fresh install)
    and a note says how to use a real one: its folder under the server's model_dirs (`gmlx
    pull` where the family's models are published)."""
    family = NOTED_FAMILY[name]
    embedded = importlib.import_module(f"gmlx_server.engine.families.{family}.embedded")
    model = embedded.MODEL_NAME
    assert _models_named(name) == ({model}, {model})
    (note,) = [node for node in ui_workflow(name)["nodes"] if node["type"] in FRONTEND_NODES]
    (text,) = note["widgets_values"]
    assert model in text and "model_dirs" in text
    assert ("gmlx pull" in text) == bool(family_specs()[family].published)


@pytest.mark.parametrize(
    "name", ["gmlx_flux2_klein_edit_two_references", "gmlx_flux3_klein_edit_two_references"]
)
def test_a_klein_edit_example_attaches_two_vae_encoded_references(name):
    """Both LoadImage pictures go through the gmlx VAE (stock VAEEncode) into a chain of stock
    ReferenceLatent nodes on the prompt, which is the sampler's positive."""
    api = api_workflow(name)
    (sampler,) = [node for node in api.values() if node["class_type"] == "KSampler"]
    chain, node_id = [], sampler["inputs"]["positive"][0]
    while api[node_id]["class_type"] == "ReferenceLatent":
        chain.append(api[node_id])
        node_id = api[node_id]["inputs"]["conditioning"][0]
    assert api[node_id]["class_type"] == "CLIPTextEncode" and len(chain) == 2
    images = set()
    for reference in chain:
        encode = api[reference["inputs"]["latent"][0]]
        assert encode["class_type"] == "VAEEncode"
        assert api[encode["inputs"]["vae"][0]]["class_type"] == "GmlxVAELoader"
        images.add(encode["inputs"]["pixels"][0])
    assert {api[i]["class_type"] for i in images} == {"LoadImage"} and len(images) == 2


@pytest.mark.parametrize("name", NAMES)
def test_ui_file_converts_to_its_api_copy(name):
    assert ui_to_api(ui_workflow(name)) == api_workflow(name)


def test_the_lora_example_ships_its_lora_bypassed():
    """A fresh install has no LoRA file: the LoRA node is bypassed, so the model goes straight
    to the sampler, and a note says how to use it."""
    ui = ui_workflow("gmlx_lora")
    (lora,) = [node for node in ui["nodes"] if node["type"] == "LoraLoaderModelOnly"]
    assert lora["mode"] == 4
    api = api_workflow("gmlx_lora")
    assert "LoraLoaderModelOnly" not in {node["class_type"] for node in api.values()}
    (sampler,) = [node for node in api.values() if node["class_type"] == "KSampler"]
    assert api[sampler["inputs"]["model"][0]]["class_type"] == "GmlxModelLoader"


def test_a_mode_the_conversion_does_not_know_is_refused():
    ui = ui_workflow("gmlx_text_to_image")
    ui["nodes"][0]["mode"] = 2
    with pytest.raises(ValueError, match="mode 2"):
        ui_to_api(ui)


def test_widget_values_left_over_are_refused():
    ui = ui_workflow("gmlx_text_to_image")
    ui["nodes"][0]["widgets_values"].append("extra")
    with pytest.raises(ValueError, match="unused"):
        ui_to_api(ui)


def test_the_distribution_ships_both_folders():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"
    ]
    data = setuptools["package-data"]
    assert {"*.json", "*.jpg"} <= set(data["gmlx_comfy.example_workflows"])
    assert "*.json" in data["gmlx_comfy.api_workflows"]
    found = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")["packages"]()
    assert {"gmlx_comfy.example_workflows", "gmlx_comfy.api_workflows"} <= set(found)
