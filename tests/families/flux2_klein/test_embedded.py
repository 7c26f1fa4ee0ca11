"""The embedded FLUX.2 klein beyond what every embedded model is
(tests/families/test_embedded_models.py): its pipeline reads it as the distilled 4B."""

from __future__ import annotations

from pathlib import Path

import pytest
from gmlx_server.engine.families.flux2_klein import embedded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return embedded.ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def test_the_pipeline_reads_it_as_the_distilled_4b(model_dir):
    """diffusers' Flux2KleinPipeline reads the folder as the distilled model, its DiT taking
    the three tapped layers of the text encoder (every parameter read:
    tests/families/test_embedded_models.py)."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(model_dir))
    assert pipe.config.is_distilled and pipe.transformer.config.joint_attention_dim == 96
