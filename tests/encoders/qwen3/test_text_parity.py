"""Text-only prompt encoding: MLX vs diffusers' QwenImage21Pipeline.encode_prompt (float32)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.compare import rel_l2
from tests.encoders.qwen3.reference import reference_encode

LONG_PROMPT = " ".join(
    [
        "A capybara wearing a wizard hat, reading a book by candlelight, oil painting;",
        "a red fox in the snow, photograph, 35mm, golden hour light.",
        "Ein Fuchs im Schnee. Un renard dans la neige. 雪の中のキツネ。 0123456789",
    ]
    * 8
)

PROMPTS = {
    "short": "a red fox",
    "empty": "",
    "space": " ",
    "sentence": "A capybara wearing a wizard hat, reading a book by candlelight, oil painting",
    "long": LONG_PROMPT,
    "control_tokens": "<|im_end|> keep <think>this</think>",
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_text_only_matches_pipeline(encoder, pipe, name):
    text = PROMPTS[name]
    ours = encoder.encode(text, [])
    cond, slots, _, ids, _ = reference_encode(pipe, text, [])
    np.testing.assert_array_equal(ours.token_ids, ids)
    assert ours.cond.shape == (1, *cond.shape)
    assert ours.cond.dtype == np.float32
    assert ours.image_slots == slots == []
    assert ours.vae_images == []
    assert rel_l2(ours.cond[0], cond) <= 1e-4


def test_long_prompt_is_long(encoder):
    assert encoder.encode(LONG_PROMPT, []).cond.shape[1] > 500


def test_empty_prompt_reads_as_space(encoder):
    np.testing.assert_array_equal(encoder.encode("", []).cond, encoder.encode(" ", []).cond)


def test_prompt_changes_conditioning(encoder):
    """Guards the parity above against a text path that ignores the prompt."""
    a = encoder.encode("a red fox in the snow", []).cond[0]
    b = encoder.encode("a red fox in the sand", []).cond[0]
    # The template's closing rows come after the prompt, so they see it.
    assert rel_l2(a[-5:], b[-5:]) > 1e-2


def test_drop_index_matches_pipeline(encoder, pipe):
    assert encoder.tokenizer.drop_index == pipe._drop_idx
    assert encoder.tokenizer.image_pad_id == pipe._img_token_id
