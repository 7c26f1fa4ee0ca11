"""Qwen3.5's language model in MLX (encoders/qwen35/text.py) against transformers'
Qwen3_5TextModel on tiny random weights of two shapes, float32: every hidden state, relative
L2 <= 1e-4, for prompts of one chunk of the delta rule and of several (64 tokens a chunk)."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.encoders.qwen35.text import load_text_model

from tests.compare import rel_l2
from tests.families.tiny_weights import redraw

TOLERANCE = 1e-4
CONFIGS = {
    # grouped value heads (two value heads per key head), a quarter of each head rotated
    "grouped": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
    },
    # as many value heads as key heads, half of each head rotated, full attention first
    "plain": {
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 3,
        "linear_num_value_heads": 3,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 3,
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000.0,
            "partial_rotary_factor": 0.5,
        },
    },
}
VOCAB = 300


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    import torch
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=VOCAB, **CONFIGS[request.param])
    model = Qwen3_5TextModel(config).eval()
    redraw(model, torch.Generator().manual_seed(1), 1.0, 0.3, lambda n, p: p.ndim >= 2)
    with torch.no_grad():  # decays and rates of a trained model's order
        for layer in model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(
                    torch.linspace(-2.0, 1.0, layer.linear_attn.A_log.numel())
                )
                layer.linear_attn.dt_bias.uniform_(-1.0, 1.0)
    folder = tmp_path_factory.mktemp(f"qwen35_{request.param}")
    model.save_pretrained(str(folder))
    return model, load_text_model(folder)[0]


@pytest.mark.parametrize("length", [5, 64, 150])
def test_every_hidden_state_equals_transformers(tiny, length):
    import torch

    reference, ours = tiny
    ids = np.random.default_rng(length).integers(0, VOCAB, length)
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)[None], output_hidden_states=True)
    states = [h[0].numpy() for h in expected.hidden_states]
    layers = ours.config.num_layers
    got = ours.hidden_states(ids, range(layers + 1))
    assert len(states) == layers + 1
    for index, (mine, theirs) in enumerate(zip(got, states, strict=True)):
        assert rel_l2(np.array(mine), theirs) <= TOLERANCE, index
    # the last tap is after the final norm, as transformers' last hidden state
    assert rel_l2(np.array(got[-1]), expected.last_hidden_state[0].numpy()) <= TOLERANCE
    worst = max(rel_l2(np.array(m), t) for m, t in zip(got, states, strict=True))
    print(f"FIGURE qwen35 length {length}: worst rel-L2 {worst:.1e}")
