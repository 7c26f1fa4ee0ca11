"""What every embedded model must be (engine/embedded.py), checked the same way for each: a
folder named by its model id that its family identifies, generated the same way twice and
reused while its stamp is current, small on disk. A family's own test_embedded keeps what is its
own (its layout, its reference pipeline reading every parameter, its prompt moving the image)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gmlx_server.engine.embedded import STAMP_FILE
from gmlx_server.engine.registry import embedded_modules
from gmlx_server.engine.spec import family_specs

MODULES = {module.MODEL_NAME: module for module in embedded_modules()}
MAX_BYTES = 12_000_000


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module", params=sorted(MODULES))
def made(request, tmp_path_factory):
    module = MODULES[request.param]
    return module, module.ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def test_every_family_that_names_an_embedded_model_has_one():
    named = {spec.embedded for spec in family_specs().values() if spec.embedded}
    assert named == {module.__name__ for module in MODULES.values()}
    assert len(MODULES) == 6


def test_the_folder_is_named_identified_by_its_family_and_small(made):
    module, folder = made
    assert folder.name == module.MODEL_NAME
    spec = next(s for s in family_specs().values() if s.embedded == module.__name__)
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
