"""A tiny random Qwen-Image 2.1 DiT (diffusers' QwenImage21Transformer2DModel), saved to a folder.

Default initialisation leaves the prompt and the reference tokens with almost no influence on the
output (about 0.1 %), too little for a parity test to notice a broken text path. So linear weights
are re-drawn larger and constant-initialised parameters (norm weights, zero-centred scales) get a
little noise before saving.
"""

from __future__ import annotations

from pathlib import Path

from ...tiny_weights import redraw

TINY_CONFIG = {
    "patch_size": 1,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "context_in_dim": 64,
    "mlp_ratio": 3,
    "axes_dims_rope": (4, 6, 6),
}

# Linear weights ~ N(0, (LINEAR_GAIN / sqrt(fan_in))^2); default kaiming-uniform is 1 / sqrt(3 fan_in).
LINEAR_GAIN = 1.0
# Spread given to parameters that start constant (ones or zeros).
CONSTANT_NOISE = 0.1


def build_transformer(directory: Path, seed: int = 0, **config_overrides):
    """Build, perturb and save a tiny transformer into `directory`; return the torch model."""
    import torch
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(**{**TINY_CONFIG, **config_overrides})
    generator = torch.Generator().manual_seed(seed + 1)
    redraw(model, generator, LINEAR_GAIN, CONSTANT_NOISE)
    model.eval()
    model.save_pretrained(str(directory))
    return model
