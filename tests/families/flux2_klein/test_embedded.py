"""The embedded FLUX.2 klein: a real-format Flux2KleinPipeline folder generated without torch,
whose inventories are diffusers' and transformers' own parameters, which the family serves as
the distilled 4B and whose prompt visibly moves the output."""

from __future__ import annotations

from pathlib import Path

import pytest
from gmlx_server.engine.embedded import STAMP_FILE
from gmlx_server.engine.families.flux2_klein import embedded, family

from tests.families.z_image.test_embedded import _files


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return embedded.ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def test_folder_is_named_and_laid_out_as_the_pipeline(model_dir):
    assert model_dir.name == embedded.MODEL_NAME == "flux2-klein-random-tiny"
    assert set(_files(model_dir)) == {
        "model_index.json",
        "scheduler/scheduler_config.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        STAMP_FILE,
    }
    assert family.FLUX2_KLEIN.spec.identify(model_dir) == ("flux2_klein", "distilled")
    assert sum(len(data) for data in _files(model_dir).values()) < 6_000_000


def test_the_pipeline_reads_it_as_the_distilled_4b(model_dir):
    """diffusers' Flux2KleinPipeline reads the folder as the distilled model, its DiT taking
    the three tapped layers of the text encoder (every parameter read:
    tests/families/test_embedded_models.py)."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(model_dir))
    assert pipe.config.is_distilled and pipe.transformer.config.joint_attention_dim == 96
