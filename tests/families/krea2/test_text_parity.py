"""Krea 2's prompt encoding against Krea2Pipeline.get_text_hidden_states on the tiny folder:
the pipeline's real (unmasked) rows, stacked layers flattened per token, relative L2 <= 1e-4 in
float32; a prompt past the pipeline's length is cut where it cuts it."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.families.krea2.prompt import Krea2PromptEncoder
from gmlx_server.engine.families.krea2.spec import SUFFIX

from tests.compare import rel_l2
from tests.families.krea2.tiny import build_tiny_folder, reference_pipeline

PROMPTS = ["a red fox in the snow", "", "a capybara reading a book by candlelight " * 40]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_folder(tmp_path_factory.mktemp("krea2_text") / "krea2-tiny")


@pytest.fixture(scope="module")
def both(folder):
    return reference_pipeline(folder), Krea2PromptEncoder.load(folder)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "empty", "cut"])
def test_the_encoding_is_the_pipelines_unmasked_rows(both, prompt):
    pipe, encoder = both
    states, mask = pipe.get_text_hidden_states(prompt, device="cpu")
    want = states[0][mask[0]].detach().numpy()
    want = want.reshape(1, want.shape[0], -1)
    got = encoder.encode(prompt)
    assert got.shape == want.shape
    assert rel_l2(got, want) <= 1e-4


def test_a_long_prompt_is_cut_to_the_pipelines_length(both):
    _, encoder = both
    cut = encoder.encode(PROMPTS[2])
    longer = encoder.encode(PROMPTS[2] + " and more words at the end")
    # 512 + 34 - 5 prefix and prompt tokens, the suffix (5 tokens in Qwen's own vocabulary), the
    # first 34 dropped
    suffix = len(encoder.tokenizer.encode(SUFFIX, add_special_tokens=False).ids)
    assert cut.shape[1] == 512 - 5 + suffix
    assert cut.shape == longer.shape and np.array_equal(cut, longer)
