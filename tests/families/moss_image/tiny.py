"""The tests' tiny MOSS-Image folders of two shapes, and upstream's MLX port as the reference.

diffusers has no MOSS-Image, and upstream's torch pipeline (`pipeline_moss_image`) cannot be
had here; the reference is `moss-image-mlx` (PyPI), an MLX port that says it mirrors the
official pipeline operation by operation and was checked against it. It is a second opinion,
not the truth: its DiT and scheduler, run in float32, against ours on the same files. The VAE's
reference is diffusers' `AutoencoderKLFlux2`, the text encoder's transformers' Qwen3.5.

- "embedded": the product's embedded recipe (24 blocks of 32 wide, two heads; Qwen3.5 32 wide);
- "wide": 23 blocks of 48 wide in three heads, a 64-wide time sinusoid, the Qwen3.5 48 wide with
  its attention layers half rotated and its value heads grouped as the key heads.
"""

from __future__ import annotations

from pathlib import Path

from gmlx_server.engine.families.moss_image.embedded import (
    TINY_QWEN35_TEXT,
    TRANSFORMER_CONFIG,
    VAE_CONFIG,
    write_embedded_model,
)

SHAPES = {
    "embedded": (TRANSFORMER_CONFIG, TINY_QWEN35_TEXT),
    "wide": (
        {
            **TRANSFORMER_CONFIG,
            "dim": 48,
            "ffn_dim": 80,
            "num_heads": 3,
            "num_layers": 23,
            "text_dim": 48,
            "freq_dim": 64,
            "rope_base": 2000.0,
        },
        {
            **TINY_QWEN35_TEXT,
            "hidden_size": 48,
            "intermediate_size": 96,
            "head_dim": 16,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "linear_num_value_heads": 2,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 3,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000.0,
                "partial_rotary_factor": 0.5,
            },
        },
    ),
}


def build_tiny_folder(root: Path, shape: str = "embedded", seed: int = 0, **vae) -> Path:
    """The folder of a shape (`vae`: overrides of the tiny VAE's config)."""
    transformer, text = SHAPES[shape]
    write_embedded_model(root, seed, transformer=transformer, text=text, vae={**VAE_CONFIG, **vae})
    return root


def reference_dit(folder: Path):
    """The port's DiT of the folder, in float32."""
    import mlx.core as mx
    from moss_image_mlx.dit import load_transformer

    return load_transformer(Path(folder) / "transformer", mx.float32)
