"""The tiny-checkpoint recipe of the twin-blocks family: a complete folder of random weights
(model_index.json, transformer/, text_encoder/, vae/), and the same folder with a LoRA merged
into its files (the reference a patched step must equal)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .dit import QKV, SINGLE_LINEARS, STREAM_LINEARS, STREAMS, TOP_LINEARS

PIPELINE_CLASS = "GmlxTwinBlocksPipeline"
TRANSFORMER = {
    "channels": 4,
    "text_width": 8,
    "hidden": 16,
    "heads": 2,
    "double_blocks": 2,
    "single_blocks": 2,
    "mlp": 24,
}
VAE = {"stride": 8, "scaling_factor": 0.5}


def linear_shapes(config: dict = TRANSFORMER) -> dict[str, tuple[int, int]]:
    """Every linear weight of the DiT by its file name less `.weight`: (out, in)."""
    hidden, mlp = config["hidden"], config["mlp"]
    shapes = {"time_in": (hidden, 1), "img_in": (hidden, config["channels"])}
    shapes |= {"txt_in": (hidden, config["text_width"]), "proj_out": (config["channels"], hidden)}
    assert set(shapes) == set(TOP_LINEARS.values())
    per_block = {f"attn.{name}": (hidden, hidden) for name in (*QKV, "to_out")}
    per_block |= {"mlp.up": (mlp, hidden), "mlp.down": (hidden, mlp)}
    for i in range(config["double_blocks"]):
        for stream in STREAMS:
            names = [n for names in STREAM_LINEARS.values() for n in names]
            shapes |= {f"double_blocks.{i}.{stream}_{n}": per_block[n] for n in names}
    for i in range(config["single_blocks"]):
        names = [n for names in SINGLE_LINEARS.values() for n in names]
        shapes |= {f"single_blocks.{i}.{n}": per_block[n] for n in names}
    return shapes


def write_folder(root: Path, name: str = "twin-tiny", seed: int = 0, merged=None) -> Path:
    """A model folder of random weights; `merged` (layer -> delta (out, in)) is added to the
    DiT's linear weights as written."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / name
    dit = {
        name + ".weight": (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        for name, shape in linear_shapes().items()
    }
    dit["norm_out.weight"] = (1.0 + 0.1 * rng.standard_normal(TRANSFORMER["hidden"])).astype(
        np.float32
    )
    for layer, delta in (merged or {}).items():
        dit[layer + ".weight"] = (dit[layer + ".weight"] + delta).astype(np.float32)
    patch = VAE["stride"] ** 2 * 3
    channels = TRANSFORMER["channels"]
    vae = {
        "encoder.weight": (rng.standard_normal((channels, patch)) / np.sqrt(patch)),
        "decoder.weight": rng.random((patch, channels)),
    }
    text = {"embed.weight": rng.standard_normal((256, TRANSFORMER["text_width"]))}
    for component, config, weights in (
        ("transformer", TRANSFORMER, dit),
        ("vae", VAE, vae),
        ("text_encoder", {}, text),
    ):
        (folder / component).mkdir(parents=True, exist_ok=True)
        (folder / component / "config.json").write_text(json.dumps(config))
        arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        save_file(arrays, str(folder / component / "model.safetensors"))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": PIPELINE_CLASS}))
    return folder
