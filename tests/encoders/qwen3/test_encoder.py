"""The MLX prompt encoder's own behaviour: attention chunking, dtypes, sizes, refusals."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.families.qwen_image21.prompt import QwenImage21PromptEncoder
from gmlx_server.engine.nn import attention as module
from gmlx_server.engine.weights import component_bytes

from tests.compare import rel_l2
from tests.encoders.qwen3.test_image_parity import picture


def test_chunked_attention_equals_whole(encoder, monkeypatch):
    text, images = "a red fox in the snow " * 4, [picture(256, 320, seed=9)]
    whole = encoder.encode(text, images).cond
    monkeypatch.setattr(module, "QUERY_CHUNK", 7)  # text and vision rows both span many chunks
    chunked = encoder.encode(text, images).cond
    assert rel_l2(chunked, whole) <= 1e-6


def test_sizes(encoder, tiny_dir):
    assert encoder.hidden_size == 64
    # Everything but lm_head (vocab x hidden) and the unused final norm (hidden).
    vocab = encoder.encoder.language_model.config.vocab_size
    unused = (vocab * 64 + 64) * 4
    assert encoder.weight_bytes == component_bytes(tiny_dir / "text_encoder") - unused


def test_bfloat16_close_to_float32(encoder, tiny_dir):
    half = QwenImage21PromptEncoder.load(tiny_dir, dtype=mx.bfloat16)
    assert half.weight_bytes * 2 == encoder.weight_bytes
    text, images = "a red fox", [picture(256, 256, seed=10)]
    ours = half.encode(text, images)
    assert ours.cond.dtype == np.float32
    assert rel_l2(ours.cond, encoder.encode(text, images).cond) < 5e-2


@pytest.mark.parametrize("text", ["look <|image_pad|> here", "<|video_pad|>"])
def test_prompt_with_pad_tokens_refused(encoder, text):
    with pytest.raises(EngineInputError, match="may not contain"):
        encoder.encode(text, [])


def test_too_small_reference_refused(encoder):
    with pytest.raises(EngineInputError, match="between"):
        encoder.encode("x", [picture(128, 128)])
