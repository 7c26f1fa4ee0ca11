"""Which folders are Z-Image's, and which variant: model_index.json's pipeline class, the text
encoder's config and the scheduler's shift (config files alone, no weights)."""

from __future__ import annotations

import json

import pytest
from gmlx_server.engine.families.z_image.embedded import MODEL_INDEX
from gmlx_server.engine.families.z_image.spec import identify


def folder(root, index=MODEL_INDEX, text_type="qwen3", shift: float | None = 3.0):
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps(index))
    (root / "text_encoder").mkdir(exist_ok=True)
    (root / "text_encoder" / "config.json").write_text(json.dumps({"model_type": text_type}))
    if shift is not None:
        (root / "scheduler").mkdir(exist_ok=True)
        config = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": shift}
        (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(
    ("shift", "variant"), [(3.0, "turbo"), (6.0, "base"), (2.0, "turbo"), (5.0, "base")]
)
def test_the_variant_is_the_nearest_shift(tmp_path, shift, variant):
    assert identify(folder(tmp_path, shift=shift)) == ("z_image", variant)


def test_a_folder_without_a_scheduler_shift_is_turbo(tmp_path):
    assert identify(folder(tmp_path, shift=None)) == ("z_image", "turbo")


def test_other_pipelines_and_text_encoders_are_not_z_image(tmp_path):
    other = {**MODEL_INDEX, "_class_name": "QwenImage21Pipeline"}
    assert identify(folder(tmp_path / "other", index=other)) is None
    assert identify(folder(tmp_path / "t5", text_type="t5")) is None
