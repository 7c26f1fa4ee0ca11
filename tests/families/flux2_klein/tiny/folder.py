"""A complete tiny FLUX.2 klein folder in diffusers' Flux2KleinPipeline layout (or
Flux2KleinKVPipeline's), from the reference classes.

The transformer, VAE and text encoder (with its tokenizer folder) come from the tiny builders
beside this file, which save diffusers' and transformers' own models with `save_pretrained`;
model_index.json and the scheduler config are the pipelines' (the klein checkpoints' scheduler:
FlowMatchEulerDiscreteScheduler with dynamic shifting, its exponential time shift fed `mu`).
Torch, diffusers and transformers are test-only.
"""

from __future__ import annotations

import json
from pathlib import Path

from gmlx_server.engine.families.flux2_klein.spec import (
    NINE_B_DOUBLE_BLOCKS,
    SCHEDULER,
    model_index_of,
)

from tests.families.flux2_klein.tiny.text_encoder import build_text_encoder
from tests.families.flux2_klein.tiny.transformer import build_transformer
from tests.families.flux2_klein.tiny.vae import build_vae

# The klein checkpoints' scheduler, as the server writes it for a model from component files.
SCHEDULER_CONFIG = {**SCHEDULER, "_diffusers_version": "0.42.1"}
# family -> the DiT's double-stream blocks
DOUBLE_BLOCKS = {
    "flux2_klein": 2,
    "flux2_klein_9b": NINE_B_DOUBLE_BLOCKS,
    "flux2_klein_9b_kv": NINE_B_DOUBLE_BLOCKS,
}


def build_tiny_folder(
    root: Path, family: str = "flux2_klein", distilled: bool = True, seed: int = 0, **transformer
):
    """Write root/{model_index.json, transformer, vae, text_encoder, tokenizer, scheduler};
    return the torch transformer. The builders' configs agree with each other (joint width 96 =
    three tapped layers of the 32-wide text encoder; 128 = the VAE's 32 channels patchified)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    model = build_transformer(
        root / "transformer", seed=seed, **{"num_layers": DOUBLE_BLOCKS[family], **transformer}
    )
    build_vae(root / "vae", seed=seed)
    build_text_encoder(root, seed=seed)
    index = model_index_of(family, "distilled" if distilled else "base")
    (root / "model_index.json").write_text(
        json.dumps({**index, "_diffusers_version": "0.42.1"}, indent=2)
    )
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(SCHEDULER_CONFIG, indent=2)
    )
    return model
