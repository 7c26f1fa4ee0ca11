"""Z-Image's prompt encoding: MLX vs diffusers' ZImagePipeline._encode_prompt (float32)."""

from __future__ import annotations

import pytest
from gmlx_server.engine.families.z_image.prompt import MAX_SEQUENCE_LENGTH, ZImagePromptEncoder

from tests.compare import rel_l2
from tests.families.z_image.reference import load_encode_pipeline, reference_encode
from tests.families.z_image.tiny.text_encoder import build_text_encoder

LONG_PROMPT = " ".join(
    ["A capybara wearing a wizard hat, reading a book by candlelight, oil painting;"] * 40
)
PROMPTS = {
    "short": "a red fox",
    "empty": "",
    "space": " ",
    "sentence": "A capybara wearing a wizard hat, reading a book by candlelight, oil painting",
    "control_tokens": "<|im_end|> keep <think>this</think>",
    "long": LONG_PROMPT,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_text_encoder(tmp_path_factory.mktemp("z_image_text"))


@pytest.fixture(scope="module")
def encoder(folder):
    return ZImagePromptEncoder.load(folder)


@pytest.fixture(scope="module")
def pipe(folder):
    return load_encode_pipeline(folder)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_matches_pipeline(encoder, pipe, name):
    (expected,) = reference_encode(pipe, [PROMPTS[name]])
    cond = encoder.encode(PROMPTS[name])
    assert cond.shape == (1, *expected.shape)
    assert rel_l2(cond[0], expected) <= 1e-4


def test_batch_of_prompts_drops_each_rows_padding(encoder, pipe):
    """The pipeline pads a batch to its max length and drops each row's padding: each row
    equals that prompt encoded alone."""
    prompts = [PROMPTS["short"], PROMPTS["sentence"], PROMPTS["empty"]]
    for prompt, expected in zip(prompts, reference_encode(pipe, prompts), strict=True):
        assert rel_l2(encoder.encode(prompt)[0], expected) <= 1e-4


def test_long_prompt_is_cut_like_the_pipeline(encoder):
    assert encoder.encode(LONG_PROMPT).shape[1] == MAX_SEQUENCE_LENGTH


def test_prompt_moves_the_encoding(encoder):
    """The template's closing rows (the same tokens after any prompt) carry the prompt."""
    a, b = encoder.encode(PROMPTS["short"]), encoder.encode("a red dog")
    assert rel_l2(a[0, -4:], b[0, -4:]) > 0.05
