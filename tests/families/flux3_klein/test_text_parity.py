"""FLUX.3 klein's prompt encoding against the modular pipeline's text encoder step on the tiny
folder: the padded rows (pads included, the DiT reads them), stacked layers flattened per
token, relative L2 <= 1e-4 in float32; prompts of one and of two padded lengths, and the empty
one."""

from __future__ import annotations

import mlx.core as mx
import pytest
import torch
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
from gmlx_server.engine.families.flux3_klein.prompt import Flux3PromptEncoder
from gmlx_server.engine.families.flux3_klein.spec import PAD_MULTIPLE

from tests.compare import rel_l2
from tests.families.flux3_klein.tiny import OUT_LAYERS, build_tiny_folder, reference_pipeline

PROMPTS = ["a red fox in the snow", "", "a capybara reading a book by candlelight " * 4]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    folder = build_tiny_folder(tmp_path_factory.mktemp("flux3_text") / "flux3-tiny")
    return reference_pipeline(folder), Flux3PromptEncoder.load(folder)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "empty", "two_pads"])
def test_the_encoding_is_the_pipelines(both, prompt):
    pipe, encoder = both
    with torch.no_grad():
        want = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
            pipe.text_encoder, pipe.tokenizer, prompt, "cpu", hidden_states_layers=OUT_LAYERS
        ).numpy()
    got = encoder.encode(prompt)
    assert got.shape == want.shape and got.shape[1] % PAD_MULTIPLE == 0
    assert rel_l2(got, want) <= 1e-4


def test_a_longer_prompt_pads_to_the_next_multiple(both):
    _, encoder = both
    assert encoder.encode(PROMPTS[0]).shape[1] == PAD_MULTIPLE
    assert encoder.encode(PROMPTS[2]).shape[1] == 2 * PAD_MULTIPLE


def test_the_vision_tower_is_never_loaded(tmp_path):
    """FLUX.3 klein (as Krea 2) reads its Qwen3-VL on text alone: from a folder, only the
    language model's tensors load, and the status counts those alone."""
    from gmlx_server.engine.registry import ModelRegistry
    from gmlx_server.engine.weights import estimated_bytes

    folder = build_tiny_folder(tmp_path / "flux3-tiny")
    loaded = ModelRegistry(extra_models=[folder]).acquire(folder.name)
    encoder = loaded.model.encoder.encoder
    assert "visual" not in encoder and "language_model" in encoder
    residency = loaded.model.status()["residency"]["encoder"]
    whole = estimated_bytes(folder / "text_encoder", mx.float32)
    assert residency["bytes"] == loaded.model.encoder.weight_bytes < whole
