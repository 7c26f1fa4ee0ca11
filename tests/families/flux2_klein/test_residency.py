"""FLUX.2 klein's text encoder under `[server.image] encoder_residency = "release"`
(server/memory.py): the server drops it after every encode, the next encode gives the same
conditioning, and the status says so (a release itself, for every family:
tests/families/test_conformance.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gmlx_contract import wire
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.registry import ModelRegistry

from tests.server.conftest import serve

from .tiny.folder import build_tiny_folder

PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2_residency") / "klein-tiny"
    build_tiny_folder(root)
    return root


def test_release_drops_the_encoder_after_every_encode(folder):
    image = replace(ImageConfig(), encoder_residency="release")
    config = ServerConfig(host="127.0.0.1", port=0, image=image)
    server = serve(config, ModelRegistry([], folder.name, extra_models=[folder]))
    try:
        answers = []
        for _ in range(2):
            r = server.post_json("encode", {"text": PROMPT})
            assert r.status_code == 200, r.text
            answers.append(wire.read_container(r.content).tensors["cond"].tobytes())
            status = server.call("GET", f"models/{folder.name}/status").json()
            assert status["residency"]["encoder"]["resident"] is False
            assert status["residency"]["dit"]["resident"] is True
        assert answers[0] == answers[1]
    finally:
        server.close()
