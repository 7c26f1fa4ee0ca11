"""A tiny random Qwen3 text encoder and tokenizer folder for Z-Image tests: the embedded
Z-Image's recipe (server/engine/families/z_image/embedded.py: a Qwen3ForCausalLM of width 32,
a small byte-level BPE with Qwen's added tokens and a compact Qwen3 chat template with its
thinking switch)."""

from __future__ import annotations

from pathlib import Path

from gmlx_server.engine.families.z_image import embedded


def build_text_encoder(model_dir: Path, seed: int = 0) -> Path:
    """Write model_dir/text_encoder and model_dir/tokenizer; returns model_dir."""
    embedded.write_text_encoder(Path(model_dir), seed)
    return Path(model_dir)
