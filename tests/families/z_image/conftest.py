"""The tiny Z-Image turbo folder and its server, shared by the pipeline parities of this folder."""

from __future__ import annotations

import pytest

from tests.families.routes import served_folder
from tests.families.z_image.tiny.folder import build_tiny_folder


@pytest.fixture(scope="package")
def turbo_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("z_image_pipeline") / "z-image-tiny"
    build_tiny_folder(root, variant="turbo")
    return root


@pytest.fixture(scope="package")
def turbo_server(turbo_folder):
    with served_folder(turbo_folder) as server:
        yield server
