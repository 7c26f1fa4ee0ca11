"""The tiny Z-Image as ComfyUI's model folders hold it: the diffusers folder's weights written as
ComfyUI's single files (the DiT in NextDiT names under `model.diffusion_model.`, Qwen3 as one
file, FLUX.1's VAE in ldm names) in a ComfyUI checkout's `models/`, with ComfyUI's copy of the
tokenizer. FLUX.1's VAE has 32 groups per norm, which its file cannot say: the tiny VAE takes
them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from gmlx_server.engine import components
from gmlx_server.engine.families.z_image import embedded
from gmlx_server.engine.families.z_image.layout import DiTConfig
from gmlx_server.engine.spec import read_config

from tests.engine.comfy_files import float32_weights, ldm_vae, write_comfy_tokenizer
from tests.engine.component_sets import ComfySet
from tests.families.z_image.test_gguf import comfy_layout

VAE = {"norm_num_groups": 32, "block_out_channels": [32, 32, 32, 32]}
DIT_FILE = "z_image_turbo_tiny.safetensors"
ENCODER_FILE = "qwen_3_tiny.safetensors"
VAE_FILE = "ae_tiny.safetensors"
SET = ComfySet(DIT_FILE, ENCODER_FILE, VAE_FILE)


def write_comfy_models(root: Path) -> tuple[Path, Path]:
    """root/z-image-tiny (the diffusers folder) and root/ComfyUI/models holding the same
    weights as ComfyUI's files; returns the two."""
    folder = Path(root) / "z-image-tiny"
    embedded.write_embedded_model(folder)
    embedded.write_vae(folder / "vae", **VAE)
    dit = float32_weights(folder / "transformer")
    config = DiTConfig.from_dict(read_config(folder / "transformer"))
    state = {
        "model.diffusion_model." + name: np.concatenate([dit[part] for part in parts])
        for name, parts in comfy_layout(config).items()
    }
    state["model.diffusion_model.norm_final.weight"] = np.ones(config.dim, np.float32)
    models = SET.write(root, dit=state, vae=ldm_vae(float32_weights(folder / "vae")))
    shutil.copy(folder / "text_encoder" / "model.safetensors", SET.path(models, "text_encoder"))
    write_comfy_tokenizer(
        folder / "tokenizer" / "tokenizer.json", models.parent / components.COMFY_QWEN_TOKENIZER
    )
    return folder, models
