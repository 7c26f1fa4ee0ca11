"""A tiny Qwen-Image 2.1 folder (base variant) that splits over 2 and 3 ranks: the embedded
model's files with a DiT of 6 blocks and 6 heads (whole heads and blocks for either rank count; input widths of
192 and 576 cut into whole quantization groups of 32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from gmlx_server.engine.embedded import DIFFUSERS_WEIGHTS, STAMP_FILE, draw, write_component
from gmlx_server.engine.families.qwen_image21 import embedded

TRANSFORMER_CONFIG = {
    **embedded.TRANSFORMER_CONFIG,
    "num_layers": 6,
    "num_attention_heads": 6,
    "attention_head_dim": 32,
    "axes_dims_rope": [8, 12, 12],
}
GROUP_SIZE = 32  # quantization groups that whole input columns of each rank hold


def build_shard_folder(root: Path, seed: int = 0) -> Path:
    """Write the folder at root (which must not exist) and return it."""
    root = Path(root)
    shutil.copytree(embedded.ensure_embedded_model(), root)
    shutil.rmtree(root / "transformer")
    inventory = embedded.transformer_tensors(TRANSFORMER_CONFIG)
    weights = draw(inventory, np.random.default_rng([seed, 7]), embedded.CONSTANT_NOISE)
    write_component(root / "transformer", TRANSFORMER_CONFIG, weights, DIFFUSERS_WEIGHTS)
    (root / STAMP_FILE).unlink(missing_ok=True)
    # the base variant: samplings of any step count
    (root / "model_index.json").write_text(json.dumps(embedded.model_index(None)))
    return root


# A tiny Z-Image DiT that splits over 2 ranks in both modes and over 3 in pipeline mode (its
# MLP's 256 rows do not split in three): 6 heads of 16, the three stacks 1 + 1 + 2 blocks.
Z_IMAGE_TRANSFORMER = {
    "dim": 96,
    "n_heads": 6,
    "n_kv_heads": 6,
    "axes_dims": (4, 6, 6),
    "n_layers": 2,
    "n_refiner_layers": 1,
}


def build_z_image_folder(root: Path, seed: int = 0) -> Path:
    """A tiny Z-Image folder (tests/families/z_image/tiny) with Z_IMAGE_TRANSFORMER."""
    from tests.families.z_image.tiny.folder import build_tiny_folder

    build_tiny_folder(root, seed=seed, **Z_IMAGE_TRANSFORMER)
    return Path(root)


# A tiny Krea 2 DiT that splits over 2 ranks in both modes: 4 query heads over 2 key/value heads
# of 16, 2 main blocks (its text fusion stays whole on every rank).
KREA2_TRANSFORMER = {"num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def build_krea2_folder(root: Path, seed: int = 0) -> Path:
    """A tiny Krea 2 folder (tests/families/krea2/tiny.py) with KREA2_TRANSFORMER."""
    from tests.families.krea2.tiny import build_tiny_folder

    return build_tiny_folder(root, seed=seed, **KREA2_TRANSFORMER)
