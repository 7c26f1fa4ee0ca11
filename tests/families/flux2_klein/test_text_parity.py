"""FLUX.2 klein's prompt encoder against Flux2KleinPipeline's `_get_qwen3_prompt_embeds` on the
tiny Qwen3 (float32): the padded 512 rows of the three tapped layers, the padding's rows
included."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from gmlx_server.engine.families.flux2_klein.prompt import MAX_SEQUENCE_LENGTH, Flux2PromptEncoder

from tests.compare import rel_l2
from tests.families.flux2_klein.tiny.text_encoder import build_text_encoder

PROMPTS = ["a red fox in the snow", "", "Ein Fuchs im Schnee. " * 3]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    folder = build_text_encoder(tmp_path_factory.mktemp("flux2_text"))
    model = Qwen3ForCausalLM.from_pretrained(folder / "text_encoder", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    return (model, tokenizer), Flux2PromptEncoder.load(folder, mx.float32)


def reference(model, tokenizer, prompt: str) -> np.ndarray:
    from diffusers import Flux2KleinPipeline

    with torch.no_grad():
        embeds = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            model, tokenizer, prompt, device=torch.device("cpu")
        )
    return embeds.numpy()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_encode_matches_the_pipeline(encoders, prompt):
    (model, tokenizer), ours = encoders
    expected = reference(model, tokenizer, prompt)
    got = ours.encode(prompt)
    assert got.shape == expected.shape == (1, MAX_SEQUENCE_LENGTH, 96)
    assert rel_l2(got, expected) <= 1e-4
    _, length = ours.token_ids(prompt)
    # the padding's rows are the pipeline's too, not only the prompt's
    assert rel_l2(got[:, length:], expected[:, length:]) <= 1e-4


def test_prompts_differ(encoders):
    _, ours = encoders
    assert rel_l2(ours.encode(PROMPTS[0]), ours.encode(PROMPTS[2])) > 0.05
