"""A tiny random Z-Image DiT (diffusers' ZImageTransformer2DModel) in a folder: the embedded
Z-Image's recipe (server/engine/families/z_image/embedded.py: linear weights re-drawn at a full
1/sqrt(fan_in) spread, norm scales, biases and pad tokens given noise, so the caption visibly
moves the output), loaded back as the diffusers reference."""

from __future__ import annotations

from pathlib import Path

from gmlx_server.engine.families.z_image import embedded

TINY_CONFIG = {
    key: value for key, value in embedded.TRANSFORMER_CONFIG.items() if not key.startswith("_")
}


def build_transformer(directory: Path, seed: int = 0, **config_overrides):
    """Write a tiny transformer into `directory`; return it as the diffusers model."""
    from diffusers import ZImageTransformer2DModel

    embedded.write_transformer(Path(directory), seed, **config_overrides)
    model = ZImageTransformer2DModel.from_pretrained(str(directory))
    return model.eval()
