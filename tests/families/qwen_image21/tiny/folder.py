"""A complete tiny Qwen-Image 2.1 folder in diffusers layout, from the reference classes.

The transformer, VAE and text encoder (with its processor folder) come from the tiny builders
beside this file, which save diffusers' and transformers' own models with `save_pretrained`;
model_index.json, the turbo sigmas and the scheduler config are the ones the embedded model
writes, so there is one description of a Qwen-Image 2.1 folder. Torch, diffusers and transformers
are test-only.
"""

from __future__ import annotations

import json
from pathlib import Path

from gmlx_server.engine.families.qwen_image21.embedded import (
    SAMPLE_SIGMAS,
    SCHEDULER_CONFIG,
    model_index,
)

from tests.families.qwen_image21.tiny.text_encoder import build_text_encoder
from tests.families.qwen_image21.tiny.transformer import build_transformer
from tests.families.qwen_image21.tiny.vae import build_vae

# Qwen-Image 2.1 turbo's fixed sigmas (docs/contract.md §2.3), excluding the terminal 0.0.
TURBO_SIGMAS = SAMPLE_SIGMAS


def build_tiny_folder(root: Path, seed: int = 0, variant: str = "base") -> Path:
    """Write root/{model_index.json, transformer, vae, text_encoder, processor, scheduler} and
    return root. `variant` "turbo" sets the fixed sample_sigmas, "base" leaves them null.

    The tiny builders' default configs agree with each other (text width 64 = the transformer's
    context width = the vision output; 16 latent channels in the VAE and the transformer)."""
    if variant not in ("base", "turbo"):
        raise ValueError(f"variant is 'base' or 'turbo', not {variant!r}")
    sigmas = TURBO_SIGMAS if variant == "turbo" else None
    write_tiny_folder(root, seed, sigmas)
    return Path(root)


def write_tiny_folder(
    root: Path,
    seed: int = 0,
    sample_sigmas: list[float] | None = None,
    scheduler_config: dict | None = SCHEDULER_CONFIG,
):
    """Write the tiny folder with these `sample_sigmas` (None: a base variant) and
    `scheduler_config` (None: no scheduler folder); return the torch transformer."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    transformer = build_transformer(root / "transformer", seed=seed)
    build_vae(root / "vae", seed=seed)
    build_text_encoder(root, seed=seed)
    (root / "model_index.json").write_text(json.dumps(model_index(sample_sigmas), indent=2))
    if scheduler_config is not None:
        (root / "scheduler").mkdir(exist_ok=True)
        (root / "scheduler" / "scheduler_config.json").write_text(
            json.dumps(scheduler_config, indent=2)
        )
    return transformer
