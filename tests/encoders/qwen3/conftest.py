"""A tiny Qwen3-VL text encoder folder, its MLX encoder and diffusers' pipeline (once per session)."""

from __future__ import annotations

import pytest

from tests.families.qwen_image21.tiny.text_encoder import build_text_encoder


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_text_encoder(tmp_path_factory.mktemp("qwen_text"), seed=0)


@pytest.fixture(scope="session")
def encoder(tiny_dir):
    from gmlx_server.engine.families.qwen_image21.prompt import QwenImage21PromptEncoder

    return QwenImage21PromptEncoder.load(tiny_dir)


@pytest.fixture(scope="session")
def pipe(tiny_dir):
    from tests.encoders.qwen3.reference import load_pipeline

    return load_pipeline(tiny_dir)
