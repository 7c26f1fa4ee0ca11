"""The Qwen-Image VAE in Wan 2.1's names (ComfyUI's `qwen_image_vae.safetensors`): the test's
Wan naming is the one diffusers' own converter (`convert_wan_vae_to_diffusers`) reads, the
product's map (vaes/wan_names.py) gives diffusers' names back, and a VAE folder holding the
Wan-named file decodes and encodes as the diffusers-named one, bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.vaes import wan_names
from gmlx_server.engine.vaes.qwen_image import QwenImageVAE
from safetensors.numpy import save_file

from tests.engine.comfy_files import wan_vae
from tests.vaes.qwen_image.test_parity import tiny_vae

# The real layout's shape (four levels, two resnets a level, as diffusers' converter's fixed
# indices assume), narrow.
CONFIG = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_vae(CONFIG, 3)
    folder = tmp_path_factory.mktemp("qwen_image_vae")
    model.save_pretrained(str(folder))
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return folder, weights


def test_the_wan_names_are_the_ones_diffusers_converts(tiny):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    _, weights = tiny
    wan = wan_vae(weights)
    assert wan_names.is_wan(wan) and not wan_names.is_wan(weights)
    converted = convert_wan_vae_to_diffusers(dict(wan))
    assert set(converted) == set(weights)
    assert all(np.array_equal(converted[n], weights[n]) for n in weights)
    ours = wan_names.renamed(wan)
    assert set(ours) == set(weights)
    assert all(np.array_equal(ours[n], weights[n]) for n in weights)


def test_a_wan_named_file_reads_as_the_diffusers_named_one(tiny, tmp_path):
    import shutil

    folder, weights = tiny
    wan_folder = tmp_path / "vae"
    wan_folder.mkdir()
    shutil.copy(folder / "config.json", wan_folder / "config.json")
    save_file(wan_vae(weights), str(wan_folder / "diffusion_pytorch_model.safetensors"))
    ours, theirs = QwenImageVAE.load(wan_folder), QwenImageVAE.load(folder)
    latents = mx.array(np.random.default_rng(1).standard_normal((1, 16, 5, 6)).astype(np.float32))
    image = mx.array(np.random.default_rng(2).random((1, 40, 48, 3), dtype=np.float32))
    assert np.array_equal(np.array(ours.decode(latents)), np.array(theirs.decode(latents)))
    assert np.array_equal(np.array(ours.encode(image)), np.array(theirs.encode(image)))


COMFY_DIR = os.environ.get("COMFYUI_DIR")


@pytest.mark.skipif(
    not (COMFY_DIR and (Path(COMFY_DIR) / "comfy" / "ldm" / "wan" / "vae.py").is_file()),
    reason="COMFYUI_DIR does not name a ComfyUI checkout with the Wan VAE",
)
def test_comfyuis_own_wan_vae_reads_the_file_and_decodes_as_this_one(tiny, tmp_path):
    """ComfyUI's WanVAE, built at the tiny config, loads the Wan-named file strictly and
    decodes it as this server does; at full size its names are those the test's naming gives
    diffusers' full-size AutoencoderKLQwenImage, which the product's map takes back."""
    import json
    import subprocess
    import sys

    from diffusers import AutoencoderKLQwenImage

    folder, weights = tiny
    save_file(wan_vae(weights), str(tmp_path / "vae.safetensors"))
    latents = np.random.default_rng(5).standard_normal((1, 16, 4, 6)).astype(np.float32)
    np.save(tmp_path / "latents.npy", latents)
    script = Path(__file__).with_name("comfy_wan_vae.py")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    files = ["vae.safetensors", "config.json", "latents.npy", "comfy.npy", "names.json"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    run = subprocess.run(
        [python, str(script), *(str(tmp_path / f) for f in files)],
        cwd=COMFY_DIR,
        env={**os.environ, "PYTHONPATH": COMFY_DIR},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ours = np.array(QwenImageVAE.load(folder).decode(mx.array(latents)))[0]
    comfy = np.load(tmp_path / "comfy.npy")
    difference = np.linalg.norm(ours - comfy) / np.linalg.norm(comfy)
    assert difference <= 1e-4
    print(f"FIGURE ComfyUI's WanVAE against this decode: rel-L2 {difference:.1e}")

    comfy_names = json.loads((tmp_path / "names.json").read_text())
    with torch_meta():
        full = AutoencoderKLQwenImage()
    shapes = {n: list(v.shape) for n, v in full.state_dict().items()}
    assert {n: shapes[d] for n, d in wan_names.diffusers_names(comfy_names).items()} == comfy_names
    assert set(wan_vae(shapes)) == set(comfy_names)


def torch_meta():
    import torch

    return torch.device("meta")
