"""Qwen3's decoder alone (`Qwen3TextEncoder`, plain RoPE) against transformers' Qwen3 (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gmlx_server.engine.encoders.qwen3.text import Qwen3TextEncoder

from tests.compare import rel_l2

CONFIG = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module", params=["Qwen3Model", "Qwen3ForCausalLM"])
def saved(request, tmp_path_factory):
    """A tiny random Qwen3 of each checkpoint layout (with and without the `model.` prefix),
    its weights drawn with a full 1/sqrt(fan_in) spread."""
    import transformers

    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = getattr(transformers, request.param)(transformers.Qwen3Config(**CONFIG)).eval()
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape)
            param.copy_(noise / param.shape[1] ** 0.5 if param.ndim == 2 else 1 + 0.1 * noise)
    model.save_pretrained(folder)
    return folder, model


def test_tapped_layers_match_transformers(saved):
    """Tap i is transformers' hidden_states[i + 1] (hidden_states[0] being the embeddings) for
    every layer but the last, whose hidden_states entry is after the final norm."""
    folder, model = saved
    ids = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], 37)
    with torch.no_grad():
        states = model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    encoder = Qwen3TextEncoder.load(folder)
    ours = encoder.hidden_states(ids, (0, -2))
    for tapped, expected in zip(ours, (states[1], states[-2]), strict=True):
        assert rel_l2(np.array(tapped), expected[0].numpy()) <= 1e-4
    assert encoder.weight_bytes > 0
