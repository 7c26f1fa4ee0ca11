"""The tiny-checkpoint recipe of the twin-blocks family: a complete folder of random weights
(model_index.json, transformer/, text_encoder/ and tokenizer/: a tiny Qwen3, vae/: a tiny
FLUX.1 AutoencoderKL). The Qwen3 and VAE folders are the embedded Z-Image's recipes of
those components, a Qwen3 32 wide and a VAE of 16 latent channels at stride 8."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gmlx_server.engine.families.z_image.embedded import write_text_encoder, write_vae
from safetensors.numpy import save_file

from .dit import Config, tensor_shapes
from .spec import PIPELINE_CLASS

# Wide enough for quantization's groups (64) and GGUF's blocks (32) in every block linear.
TRANSFORMER = {
    "in_channels": 16,
    "text_width": 32,
    "hidden": 64,
    "heads": 2,
    "double_blocks": 2,
    "single_blocks": 2,
    "mlp": 128,
}


def linear_shapes(config: dict = TRANSFORMER) -> dict[str, tuple[int, int]]:
    """Every linear weight of the DiT by its file name less `.weight`: (out, in)."""
    shapes = tensor_shapes(Config.from_dict(config))
    return {
        name.removesuffix(".weight"): shape for name, shape in shapes.items() if len(shape) == 2
    }


def write_folder(root: Path, name: str = "twin-tiny", seed: int = 0) -> Path:
    """A model folder of random weights."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / name
    dit = {
        name + ".weight": (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        for name, shape in linear_shapes().items()
    }
    dit["norm_out.weight"] = (1.0 + 0.1 * rng.standard_normal(TRANSFORMER["hidden"])).astype(
        np.float32
    )
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "transformer" / "config.json").write_text(json.dumps(TRANSFORMER))
    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in dit.items()}
    save_file(arrays, str(folder / "transformer" / "model.safetensors"))
    write_text_encoder(folder, seed=seed)
    write_vae(folder / "vae", seed=seed)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": PIPELINE_CLASS}))
    return folder
