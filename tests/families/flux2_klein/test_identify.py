"""FLUX.2 klein folders are told apart by their pipeline class, the DiT's depth and
`is_distilled`; other folders are not theirs."""

from __future__ import annotations

import json

import pytest
from gmlx_server.engine.families.flux2_klein import family as klein

from tests.families.flux2_klein.tiny.folder import build_tiny_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2_identify")
    made = {}
    for name, fam, distilled in [
        ("4b", "flux2_klein", True),
        ("4b-base", "flux2_klein", False),
        ("9b", "flux2_klein_9b", True),
        ("9b-kv", "flux2_klein_9b_kv", True),
    ]:
        build_tiny_folder(root / name, family=fam, distilled=distilled, num_single_layers=1)
        made[name] = root / name
    return made


def test_families_and_variants(folders):
    assert klein.FLUX2_KLEIN.spec.identify(folders["4b"]) == ("flux2_klein", "distilled")
    assert klein.FLUX2_KLEIN.spec.identify(folders["4b-base"]) == ("flux2_klein", "base")
    assert klein.FLUX2_KLEIN.spec.identify(folders["9b"]) == ("flux2_klein_9b", "distilled")
    assert klein.FLUX2_KLEIN.spec.identify(folders["9b-kv"]) == ("flux2_klein_9b_kv", "distilled")


def test_other_pipelines_and_encoders_are_not_klein(folders, tmp_path):
    folder = folders["4b"]
    index = json.loads((folder / "model_index.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "Flux2Pipeline"}))
    assert klein.FLUX2_KLEIN.spec.identify(other) is None


def test_sampling_rows(folders):
    distilled = klein.FLUX2_KLEIN.describe(folders["4b"])["sampling"]
    assert distilled == {
        "steps": 4,
        "cfg": 1.0,
        "shift": 1.0,
        "sigmas": None,
        "schedule": {"rule": "flux2"},
        "neg_skip": [],
        "timestep_scale": 1.0,
    }
    base = klein.FLUX2_KLEIN.describe(folders["4b-base"])["sampling"]
    assert (base["steps"], base["cfg"], base["schedule"]) == (50, 4.0, {"rule": "flux2"})
