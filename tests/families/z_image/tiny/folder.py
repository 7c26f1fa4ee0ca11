"""A complete tiny Z-Image folder in diffusers' ZImagePipeline layout, from the reference classes.

The transformer, VAE and text encoder (with its tokenizer folder) come from the tiny builders
beside this file, which save diffusers' and transformers' own models with `save_pretrained`;
model_index.json and the scheduler config are the pipeline's. Torch, diffusers and transformers
are test-only.
"""

from __future__ import annotations

import json
from pathlib import Path

from gmlx_server.engine.families.z_image.family import PIPELINE_CLASS, SAMPLING

from tests.families.z_image.tiny.text_encoder import build_text_encoder
from tests.families.z_image.tiny.transformer import build_transformer
from tests.families.z_image.tiny.vae import build_vae

MODEL_INDEX = {
    "_class_name": PIPELINE_CLASS,
    "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3ForCausalLM"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "ZImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def scheduler_config(variant: str) -> dict:
    return {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "_diffusers_version": "0.42.1",
        "num_train_timesteps": 1000,
        "shift": SAMPLING[variant]["shift"],
        "use_dynamic_shifting": False,
    }


def build_tiny_folder(root: Path, seed: int = 0, variant: str = "turbo", **transformer):
    """Write root/{model_index.json, transformer, vae, text_encoder, tokenizer, scheduler};
    return the torch transformer (`transformer`: overrides of its tiny config). The builders'
    default configs agree with each other (caption width 32 = the text encoder's width; 16
    latent channels in the VAE and the transformer)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    transformer = build_transformer(root / "transformer", seed=seed, **transformer)
    build_vae(root / "vae", seed=seed)
    build_text_encoder(root, seed=seed)
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(scheduler_config(variant), indent=2)
    )
    return transformer
