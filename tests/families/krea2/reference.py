"""The diffusers Krea 2 references on tiny random weights, and what the tests compare with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gmlx_server.engine.families.krea2.embedded import TRANSFORMER_CONFIG

from tests.families.tiny_weights import save_drawn

# A tiny Krea2Transformer2DModel: the embedded model's (grouped-query attention, 4 query heads
# over 2 key/value heads, three tapped text layers), its text fusion wider and two refiner
# blocks deep.
TINY_TRANSFORMER = {
    **{k: v for k, v in TRANSFORMER_CONFIG.items() if not k.startswith("_")},
    "text_hidden_dim": 48,
    "text_intermediate_size": 80,
    "num_refiner_text_blocks": 2,
}


def build_transformer(directory: Path, seed: int = 0, **overrides):
    """Write a tiny Krea 2 transformer into `directory`; return it as the diffusers model."""
    from diffusers import Krea2Transformer2DModel

    config = {**TINY_TRANSFORMER, **overrides}
    return save_drawn(
        Krea2Transformer2DModel, config, directory, seed, linear_gain=1.0, constant_noise=0.3
    )


def reference_dit(model, x: np.ndarray, t, conds: list[np.ndarray]) -> np.ndarray:
    """The reference's velocity (B, C, H, W) for latents x, time t = sigma per row and each
    row's text stack: the rows padded to the longest with the pipeline's mask, as it batches."""
    import torch

    batch, channels, height, width = x.shape
    longest = max(c.shape[0] for c in conds)
    stack = np.zeros((batch, longest, *conds[0].shape[1:]), np.float32)
    mask = np.zeros((batch, longest), bool)
    for row, cond in enumerate(conds):
        stack[row, : cond.shape[0]], mask[row, : cond.shape[0]] = cond, True
    p = 2
    packed = x.reshape(batch, channels, height // p, p, width // p, p).transpose(0, 2, 4, 1, 3, 5)
    packed = packed.reshape(batch, (height // p) * (width // p), channels * p * p)
    from diffusers import Krea2Pipeline

    positions = Krea2Pipeline.prepare_position_ids(longest, height // p, width // p, "cpu")
    with torch.no_grad():
        out = model(
            hidden_states=torch.from_numpy(packed),
            encoder_hidden_states=torch.from_numpy(stack),
            timestep=torch.tensor(np.asarray(t, np.float32)),
            position_ids=positions,
            encoder_attention_mask=torch.from_numpy(mask),
            return_dict=False,
        )[0].numpy()
    out = out.reshape(batch, height // p, width // p, channels, p, p).transpose(0, 3, 1, 4, 2, 5)
    return out.reshape(batch, channels, height, width)
