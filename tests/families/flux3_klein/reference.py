"""The diffusers FLUX.3 references on tiny random weights, and what the tests compare with."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.families.tiny_weights import save_drawn

# A tiny Flux3Transformer2DModel: four 16-wide heads (64 wide: its blocks quantize in groups of
# 64), one per-mode block per mode, two joint blocks, the RoPE axes a quarter of the head each
# (as the real model's).
TINY_TRANSFORMER = {
    "in_channels": 128,
    "cond_in_channels": 128,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 96,
    "timestep_channels": 32,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [4, 4, 4, 4],
    "rope_theta": 10000,
    "eps": 1e-6,
    "flow_map": True,
}


def build_transformer(directory: Path, seed: int = 0, **overrides):
    """Write a tiny FLUX.3 transformer into `directory`; return it as the diffusers model."""
    from diffusers import Flux3Transformer2DModel

    config = {**TINY_TRANSFORMER, **overrides}
    return save_drawn(
        Flux3Transformer2DModel, config, directory, seed, linear_gain=1.0, constant_noise=0.3
    )


def reference_dit(model, x: np.ndarray, t, text: np.ndarray, refs=(), targets=None) -> np.ndarray:
    """The reference's velocity (B, C, h, w) for latents x at times t, one text (B, L, D) and
    references (each (B, C, h_k, w_k)), laid out as the modular pipeline lays them."""
    import torch
    from diffusers.modular_pipelines.flux3.before_denoise import (
        Flux3TextRoPEInputsStep,
        _prepare_image_ids,
    )

    batch, channels, height, width = x.shape
    tokens = torch.from_numpy(x).flatten(2).transpose(1, 2)
    text = torch.from_numpy(np.asarray(text, np.float32))
    extra = {}
    if refs:
        extra["image_cond_hidden_states"] = torch.cat(
            [torch.from_numpy(r).flatten(2).transpose(1, 2) for r in refs], dim=1
        )
        extra["image_cond_ids"] = torch.cat(
            [_prepare_image_ids(*r.shape[2:], 0.5, l_coord=-(1 + k)) for k, r in enumerate(refs)]
        )
    if targets is not None:
        extra["target_timestep"] = torch.tensor(np.asarray(targets, np.float32))
    with torch.no_grad():
        out = model(
            hidden_states=tokens,
            encoder_hidden_states=text,
            timestep=torch.tensor(np.asarray(t, np.float32)),
            img_ids=_prepare_image_ids(height, width, 0.5),
            txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text),
            return_dict=False,
            **extra,
        )[0]
    return out.transpose(1, 2).reshape(batch, channels, height, width).numpy()
