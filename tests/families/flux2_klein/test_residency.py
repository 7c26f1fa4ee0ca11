"""FLUX.2 klein's text encoder is releasable as the other families' are
(`[server.image] encoder_residency`, server/memory.py): released, it frees its weights, and the
next encode loads it again with the same conditioning; under "release" the server drops it
after every encode, and the status says so."""

from __future__ import annotations

import gc
from dataclasses import replace

import mlx.core as mx
import pytest
from gmlx_contract import wire
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.families.flux2_klein import family
from gmlx_server.engine.registry import ModelRegistry

from tests.server.conftest import serve

from .tiny.folder import build_tiny_folder

PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2_residency") / "klein-tiny"
    build_tiny_folder(root)
    return root


def test_a_released_encoder_frees_its_weights_and_loads_again_with_the_same_conditioning(folder):
    model = family.FLUX2_KLEIN.load(folder, "released")
    first = model.encode(PROMPT, [], refs=False).cond
    encoder_bytes, all_bytes = model.encoder_bytes, model.weight_bytes
    gc.collect()
    before = mx.get_active_memory()
    assert model.release_encoder() == encoder_bytes > 0
    gc.collect()
    assert before - mx.get_active_memory() >= encoder_bytes
    assert not model.encoder_resident and model.weight_bytes == all_bytes - encoder_bytes
    assert model.status()["residency"]["encoder"]["resident"] is False
    again = model.encode(PROMPT, [], refs=False).cond
    assert model.encoder_resident and model.weight_bytes == all_bytes
    assert again.tobytes() == first.tobytes()
    model.close()


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
