"""A tiny random FLUX.2 klein DiT (diffusers' Flux2Transformer2DModel), saved to a folder.

Default initialisation leaves the caption and the references with little influence on the
output, too little for a parity test to notice a broken path, so the weights are re-drawn by
tests/families/tiny_weights.py before saving.
"""

from __future__ import annotations

from pathlib import Path

from gmlx_server.engine.families.flux2_klein import embedded

from ...tiny_weights import redraw

# The embedded klein's DiT config (three tapped layers of its 32-wide text encoder make the
# joint width 96), less diffusers' bookkeeping keys.
TINY_CONFIG = {k: v for k, v in embedded.TRANSFORMER_CONFIG.items() if not k.startswith("_")}

LINEAR_GAIN = 1.0
CONSTANT_NOISE = 0.3


def tiny_config(**overrides) -> dict:
    return {**TINY_CONFIG, **overrides}


def build_transformer(directory: Path, seed: int = 0, **config_overrides):
    """Build, perturb and save a tiny transformer into `directory`; return the torch model."""
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**tiny_config(**config_overrides))
    redraw(model, torch.Generator().manual_seed(seed + 1), LINEAR_GAIN, CONSTANT_NOISE)
    model.eval()
    model.save_pretrained(str(directory))
    return model
