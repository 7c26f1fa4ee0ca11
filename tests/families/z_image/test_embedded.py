"""The embedded Z-Image beyond what every embedded model is (tests/families/test_embedded_models.py):
what its pipeline reads of its configs and chat template, and how a server offers it."""

from __future__ import annotations

from pathlib import Path

import pytest
from gmlx_server.engine.families.z_image import embedded

from tests.catalog import EMBEDDED_MODELS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return embedded.ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def test_the_pipeline_reads_its_vae_settings_and_chat_template(model_dir):
    """diffusers' ZImagePipeline reads the folder with FLUX.1's VAE settings and the chat
    template the pipeline renders (every parameter read: tests/families/test_embedded_models.py)."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(model_dir))
    assert pipe.vae.config.scaling_factor == 0.3611 and pipe.vae.config.sample_size == 1024
    prompt = pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a fox"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\na fox<|im_end|>\n<|im_start|>assistant\n"


def test_a_server_without_a_default_offers_it_beside_the_default(tmp_path, monkeypatch):
    """With no default_model the server's registry lists every embedded model, the Qwen-Image
    2.1 one as the default, and loads the Z-Image one by its id."""
    from gmlx_server.config import ServerConfig
    from gmlx_server.process import config_registry

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    registry, extra = config_registry(ServerConfig())
    assert [folder.name for folder in extra] == EMBEDDED_MODELS
    assert registry.default_id() == "qwen-image21-random-tiny"
    entries = {entry.model_id: entry for entry in registry.entries()}
    assert (entries[embedded.MODEL_NAME].family, entries[embedded.MODEL_NAME].variant) == (
        "z_image",
        "turbo",
    )
    loaded = registry.acquire(embedded.MODEL_NAME)
    try:
        assert loaded.model.family == "z_image"
        assert loaded.model.status()["sampling"]["steps"] == 8
    finally:
        registry.release(loaded)
        registry.unload_all()


def test_the_image_commands_take_it_by_id(tmp_path, monkeypatch):
    """`gmlx image sample --model z-image-random-tiny` with no default_model configured."""
    from gmlx_server.model_choice import choose_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = tmp_path / "config.toml"
    config.write_text("[server]\nmodel_dirs = []\n")
    choice = choose_model(embedded.MODEL_NAME, config)
    assert choice.model_id == embedded.MODEL_NAME
    assert choice.registry.resolve(embedded.MODEL_NAME).family == "z_image"
    assert choice.registry.default_id() == embedded.MODEL_NAME  # what the command samples
