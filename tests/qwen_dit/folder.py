"""A complete tiny Qwen-Image 2.1 folder in diffusers layout, for the family tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tiny.text_encoder import build_text_encoder
from tests.tiny.transformer import build_transformer
from tests.tiny.vae import build_vae

TURBO_SIGMAS = [1.0, 0.95, 0.8, 0.5]
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 128,
    "max_image_seq_len": 4096,
    "base_shift": 0.4,
    "max_shift": 1.1,
    "shift_terminal": 0.05,
    "time_shift_type": "exponential",
}


def build_folder(root: Path, variant: str = "base", seed: int = 0, scheduler: bool = True):
    """Write root/{model_index.json, transformer, vae, text_encoder, processor, scheduler};
    returns the torch transformer."""
    root = Path(root)
    model = build_transformer(root / "transformer", seed=seed)
    build_vae(root / "vae", seed=seed)
    build_text_encoder(root, seed=seed)
    index = {
        "_class_name": "QwenImage21Pipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "vae": ["diffusers", "AutoencoderKLQwenImage21"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
        "sample_sigmas": TURBO_SIGMAS if variant == "turbo" else None,
    }
    (root / "model_index.json").write_text(json.dumps(index))
    if scheduler:
        (root / "scheduler").mkdir(exist_ok=True)
        (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG))
    return model
