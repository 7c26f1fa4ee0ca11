"""What every embedded model must be (engine/embedded.py), checked the same way for each: a
folder named by its model id that its family identifies, generated the same way twice and
reused while its stamp is current, small on disk, read by its reference pipeline parameter for
parameter, and made so that its prompt moves the image. A family's own test_embedded keeps what
is its own (its layout, what its pipeline reads of its configs and template)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine import file_headers
from gmlx_server.engine.embedded import STAMP_FILE
from gmlx_server.engine.registry import ModelRegistry, embedded_modules
from gmlx_server.engine.spec import family_specs

from tests.catalog import EMBEDDED_MODELS
from tests.compare import rel_l2
from tests.families.test_conformance import step
from tests.server.conftest import serve

MODULES = {module.MODEL_NAME: module for module in embedded_modules()}
MAX_BYTES = 12_000_000
# How far another prompt moves the prompt row's step at the least, relative L2 (a DiT that
# ignored its conditioning: 0). Measured 0.05 to 0.32, but 0.015 for Krea 2, whose pipeline
# puts a long template after the prompt: most conditioning rows are the same for any prompt.
PROMPT_MOVES = 0.01


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module", params=sorted(MODULES))
def made(request, tmp_path_factory):
    module = MODULES[request.param]
    return module, module.ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def test_every_family_that_names_an_embedded_model_has_one():
    named = {spec.module_name("embedded") for spec in family_specs().values()} - {None}
    assert named == {module.__name__ for module in MODULES.values()}
    assert sorted(MODULES) == sorted(EMBEDDED_MODELS)


def test_the_folder_is_named_identified_by_its_family_and_small(made):
    module, folder = made
    assert folder.name == module.MODEL_NAME
    spec = next(s for s in family_specs().values() if s.module_name("embedded") == module.__name__)
    # one answer whichever family looks (FLUX.2 klein's three specs share one identify)
    identified = {s.identify(folder) for s in family_specs().values()} - {None}
    assert identified == {spec.identify(folder)}
    assert spec.identify(folder)[0] == spec.name
    assert sum(len(data) for data in files(folder).values()) < MAX_BYTES


def test_generation_is_deterministic_and_reused(made, tmp_path):
    module, folder = made
    again = module.ensure_embedded_model(tmp_path)
    assert again != folder and files(again) == files(folder)
    weights = next((again / "transformer").glob("*.safetensors"))
    before = weights.stat().st_mtime_ns
    assert module.ensure_embedded_model(tmp_path) == again
    assert weights.stat().st_mtime_ns == before  # the stamp matched: nothing was rewritten
    stamp = json.loads((again / STAMP_FILE).read_text())
    assert stamp["name"] == module.MODEL_NAME and "random weights" in stamp["note"]


def written_shapes(component: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of a component folder's safetensors files, by name: its shape."""
    shapes = {}
    for path in sorted(component.glob("*.safetensors")):
        shapes |= file_headers.read(path).shapes
    return shapes


def test_the_reference_pipeline_reads_every_written_parameter(made):
    """diffusers' pipeline of the folder (model_index.json's class) reads it as it is, and each
    network's parameters and buffers are exactly the tensors written, by name and shape:
    nothing missing, nothing unread. (FLUX.3 klein's modular pipeline and MOSS-Image, which
    diffusers does not ship, are checked against their references in their own tests.)"""
    pytest.importorskip("torch")
    import diffusers

    module, folder = made
    name = json.loads((folder / "model_index.json").read_text())["_class_name"]
    pipeline = getattr(diffusers, name, None)
    family = next(
        s.name for s in family_specs().values() if s.module_name("embedded") == module.__name__
    )
    own_tests = f"tests/families/{family}"
    if pipeline is None:
        pytest.skip(
            f"diffusers ships no {name}; {own_tests} checks the folder against its reference"
        )
    if "Modular" in name:
        pytest.skip(
            f"{name} is a modular pipeline, built from blocks rather than read by from_pretrained;"
            f" {own_tests} checks the folder against those blocks"
        )
    given = {}
    if (folder / "processor").is_dir():  # Qwen3VLProcessor without its torchvision-gated half
        from tests.encoders.qwen3.reference import load_processor

        given["processor"] = load_processor(folder)
    pipe = pipeline.from_pretrained(str(folder), **given)
    for component in ("transformer", "vae", "text_encoder"):
        state = getattr(pipe, component).state_dict()
        loaded = {key: tuple(value.shape) for key, value in state.items()}
        assert loaded == written_shapes(folder / component), component


def test_the_prompt_moves_the_output(made):
    """The weights are drawn so that the prompt visibly moves the DiT's output
    (engine/embedded.py): served, another prompt moves the prompt row's step, the empty
    prompt's row not."""
    module, folder = made
    config = replace(ServerConfig(host="127.0.0.1", port=0), image=ImageConfig())
    live = serve(config, ModelRegistry(extra_models=[folder]))
    try:
        fox = step(live, module.MODEL_NAME, "a red fox in the snow")
        book = step(live, module.MODEL_NAME, "an oil painting of a book")
    finally:
        live.close()
    assert rel_l2(fox[0], book[0]) > PROMPT_MOVES
    assert rel_l2(fox[1], book[1]) < 1e-6


def test_the_folder_holds_the_components_its_model_index_names(made):
    """Each component model_index.json names ([library, class]) is a folder, the networks with
    their config and weights, and the folder holds nothing else but the index and the stamp."""
    _, folder = made
    index = json.loads((folder / "model_index.json").read_text())
    named = {
        key
        for key, value in index.items()
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)
    }
    assert {p.name for p in folder.iterdir()} == {*named, "model_index.json", STAMP_FILE}
    for component in named & {"transformer", "vae", "text_encoder"}:
        held = {p.name for p in (folder / component).iterdir()}
        assert "config.json" in held and any(n.endswith(".safetensors") for n in held), component
    for component in named - {"transformer", "vae", "text_encoder"}:
        assert any((folder / component).iterdir()), component
