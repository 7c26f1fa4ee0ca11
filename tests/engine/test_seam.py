"""The ImageModel seam is declared whole (engine/base.py): a model lacking a member fails its
load loudly, naming what it lacks; the test family implements every member."""

from __future__ import annotations

import pytest
from gmlx_server.engine.base import ImageModel, MemoryPlanning, seam_gaps
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.spec import Family

from tests.server import linear_family


def test_the_linear_test_family_implements_every_member():
    assert seam_gaps(linear_family.LinearModel("m", "base")) == []


def test_every_protocol_member_is_asked_for():
    members = {*ImageModel.__annotations__, *MemoryPlanning.__annotations__}
    members |= {n for p in (ImageModel, MemoryPlanning) for n, v in vars(p).items() if callable(v)}
    members = {m for m in members if not m.startswith("_")}
    assert set(seam_gaps(object())) == members
    assert {"capabilities", "plan_step", "check_patch_table", "vae_space"} <= members


class WithoutPatchTables(linear_family.LinearModel):
    check_patch_table = None  # not callable: as good as missing


def test_a_model_lacking_a_member_fails_its_load_naming_it(tmp_path):
    linear_family.make_model_folder(tmp_path, "lacking")
    family = Family(
        linear_family.LINEAR.spec, lambda path, model_id: WithoutPatchTables(model_id, "")
    )
    registry = ModelRegistry([tmp_path], families={linear_family.FAMILY: family})
    with pytest.raises(TypeError, match="check_patch_table"):
        registry.acquire("lacking")
    assert registry.loaded("lacking") is None
