"""A complete tiny Z-Image folder in diffusers' ZImagePipeline layout: the embedded Z-Image's
recipe (server/engine/families/z_image/embedded.py) at a seed and variant of the test's, its
transformer loaded back as the diffusers reference. Torch and diffusers are test-only."""

from __future__ import annotations

from pathlib import Path

from gmlx_server.engine.families.z_image import embedded


def build_tiny_folder(root: Path, seed: int = 0, variant: str = "turbo", **transformer):
    """Write root/{model_index.json, transformer, vae, text_encoder, tokenizer, scheduler};
    return the torch transformer (`transformer`: overrides of its tiny config)."""
    from diffusers import ZImageTransformer2DModel

    root = Path(root)
    embedded.write_embedded_model(root, seed, variant, transformer)
    return ZImageTransformer2DModel.from_pretrained(str(root / "transformer")).eval()
