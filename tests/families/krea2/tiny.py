"""A tiny Krea 2 folder in diffusers' Krea2Pipeline layout, from the references themselves:
the tiny DiT of reference.py, a tiny AutoencoderKLQwenImage, a tiny Qwen3VLModel text encoder
with the tests' Qwen tokenizer, the embedded model's scheduler config (the pipeline docstring's). Nothing is
downloaded; torch, diffusers and transformers are development dependencies."""

from __future__ import annotations

import json
from pathlib import Path

from gmlx_server.engine.families.krea2.spec import SCHEDULER_CONFIG, model_index_of

from tests.families.krea2.reference import build_transformer
from tests.families.qwen_image21.tiny.text_encoder import build_language_model
from tests.families.tiny_weights import redraw

TEXT_LAYERS = 4  # the tiny encoder's decoder layers; the taps below read three of them
SELECT_LAYERS = (1, 2, 3)
TEXT_WIDTH = 64
VAE = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}


def build_tiny_folder(
    root: Path,
    seed: int = 0,
    variant: str = "turbo",
    text_layers: int = TEXT_LAYERS,
    select_layers: tuple[int, ...] = SELECT_LAYERS,
    **transformer,
) -> Path:
    """Write a tiny Krea 2 folder at `root` (`transformer`: overrides of the tiny DiT's
    config; its encoder of `text_layers` layers, tapped after `select_layers`); returns it."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    root = Path(root)
    build_transformer(
        root / "transformer",
        seed,
        **{"text_hidden_dim": TEXT_WIDTH, "num_text_layers": len(select_layers), **transformer},
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(**VAE)
    redraw(vae, torch.Generator().manual_seed(seed + 1), 1.0, 0.2, lambda n, p: p.ndim >= 2)
    vae.save_pretrained(str(root / "vae"))
    build_language_model(root, seed + 2, text_layers)
    (root / "scheduler").mkdir(parents=True, exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG))
    index = model_index_of(variant, select_layers)
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root


def reference_pipeline(root: Path):
    """The folder as diffusers' Krea2Pipeline (float32, CPU)."""
    from diffusers import Krea2Pipeline

    return Krea2Pipeline.from_pretrained(str(root))
