"""The tiny Qwen-Image 2.1 folder (tests/families/qwen_image21/tiny/folder.py) with the family tests' own sigmas and
scheduler constants: they differ from the embedded model's defaults, so a test sees whether the
family read them from the folder."""

from __future__ import annotations

from pathlib import Path

from tests.families.qwen_image21.tiny.folder import write_tiny_folder

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
    sigmas = TURBO_SIGMAS if variant == "turbo" else None
    return write_tiny_folder(root, seed, sigmas, SCHEDULER_CONFIG if scheduler else None)
