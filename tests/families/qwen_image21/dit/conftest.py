"""Tiny random Qwen-Image 2.1 transformers shared by the DiT tests (built once per session)."""

from __future__ import annotations

import pytest

from tests.families.qwen_image21.tiny.transformer import build_transformer

# Several tiny shapes: the default, and one with more heads, a third block, narrower channels
# and different RoPE axes.
CONFIGS = {
    "default": {},
    "wide_heads": {
        "in_channels": 8,
        "out_channels": 8,
        "num_layers": 3,
        "attention_head_dim": 8,
        "num_attention_heads": 4,
        "context_in_dim": 32,
        "mlp_ratio": 2,
        "axes_dims_rope": (2, 2, 4),
    },
}


@pytest.fixture(scope="session")
def tiny_transformers(tmp_path_factory):
    """name -> (folder, torch model, config overrides), seeds 0 and 1."""
    built = {}
    for seed, (name, overrides) in enumerate(CONFIGS.items()):
        folder = tmp_path_factory.mktemp(f"dit_{name}")
        model = build_transformer(folder, seed=seed, **overrides)
        built[name] = (folder, model, overrides)
    return built
