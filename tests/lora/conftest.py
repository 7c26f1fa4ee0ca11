"""One tiny Qwen-Image 2.1 folder and its loaded model, shared by the LoRA tests."""

from __future__ import annotations

import pytest
from gmlx_server.engine.families.qwen_image21.family import QWEN_IMAGE21

from tests.families.qwen_image21.dit.folder import build_folder

MODEL_ID = "tiny"


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """models/tiny in diffusers layout; returns (models root, folder)."""
    root = tmp_path_factory.mktemp("lora_models")
    build_folder(root / MODEL_ID, seed=3)
    return root, root / MODEL_ID


@pytest.fixture(scope="session")
def engine(tiny_folder):
    """The family's loaded model (the object the step route calls)."""
    _, folder = tiny_folder
    model = QWEN_IMAGE21.load(folder, MODEL_ID)
    yield model
    model.close()
