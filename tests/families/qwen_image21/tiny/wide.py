"""A Qwen-Image 2.1 folder wider and deeper than the embedded default, stored in bfloat16, for
the load-peak measurements: many tensors of moderate size, so that one tensor in flight is a
small part of the whole, as in a real checkpoint.

Written from the embedded generator's inventories (the real names and shapes for a config) with
the same random draw, then rounded to bfloat16 (MLX writes the files); the tokenizer, processor,
scheduler and model_index.json are the embedded model's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from gmlx_server.engine.embedded import DIFFUSERS_WEIGHTS, draw, qwen3_vl_tensors
from gmlx_server.engine.families.qwen_image21 import embedded

TRANSFORMER = {
    **embedded.TRANSFORMER_CONFIG,
    "num_layers": 16,
    "num_attention_heads": 4,
    "attention_head_dim": 64,
    "context_in_dim": 256,
    "axes_dims_rope": [16, 24, 24],
}
TEXT = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [12, 10, 10],
        "mrope_interleaved": True,
    },
}
VISION = {"out_hidden_size": 256}
VAE = {"base_dim": 16, "decoder_base_dim": 24, "num_res_blocks": 2}
WEIGHTS = {
    "transformer": DIFFUSERS_WEIGHTS,
    "vae": DIFFUSERS_WEIGHTS,
    "text_encoder": "model.safetensors",
}


def write_wide_folder(root: Path, dtype: mx.Dtype = mx.bfloat16) -> Path:
    """Write the folder at `root` (which must not exist) with its weights stored in `dtype`."""
    root = Path(root)
    root.mkdir(parents=True)
    embedded.write_embedded_model(root)
    configs = {
        "transformer": TRANSFORMER,
        "vae": {**_config(root / "vae"), **VAE},
        "text_encoder": _text_encoder_config(_config(root / "text_encoder")),
    }
    inventories = {
        "transformer": embedded.transformer_tensors,
        "vae": embedded.vae_tensors,
        "text_encoder": qwen3_vl_tensors,
    }
    for index, (name, config) in enumerate(configs.items()):
        shutil.rmtree(root / name)
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config, indent=2))
        drawn = draw(
            inventories[name](config),
            np.random.default_rng([7, index]),
            embedded.CONSTANT_NOISE,
        )
        tensors = {key: mx.array(value).astype(dtype) for key, value in drawn.items()}
        mx.save_safetensors(str(root / name / WEIGHTS[name]), tensors, metadata={"format": "pt"})
    return root


def _config(component: Path) -> dict:
    return json.loads((component / "config.json").read_text())


def _text_encoder_config(config: dict) -> dict:
    return {
        **config,
        "text_config": {**config["text_config"], **TEXT},
        "vision_config": {**config["vision_config"], **VISION},
    }
