"""ComfyUI's own functions on the files a model from component files reads
(engine/components.py), run in ComfyUI's Python on a ComfyUI checkout (COMFYUI_DIR, as
tests/comfy/test_e2e_comfyui.py): ComfyUI's VAE conversion (`comfy/diffusers_convert.py`'s
`convert_vae_state_dict`, what its VAELoader applies to a diffusers file) writes the ldm names
the server reads back as the diffusers weights, for FLUX.1's and FLUX.2's VAEs; ComfyUI's model
detection (`comfy.model_detection.detect_unet_config`) takes the tiny Z-Image's DiT file in
ComfyUI's names for its NextDiT (Lumina 2) with the depth and caption width the server tells
from it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gmlx_server.engine.vaes import ldm_names
from safetensors.numpy import load_file, save_file

from tests.comfy.test_e2e_comfyui import MISSING_PACKAGES_STUB, NEEDS_COMFYUI
from tests.families.z_image.tiny.comfy import DIT_FILE, write_comfy_models

pytestmark = NEEDS_COMFYUI

CONVERT = """
import sys
from safetensors.torch import load_file, save_file
from comfy.diffusers_convert import convert_vae_state_dict
state = convert_vae_state_dict(load_file(sys.argv[1]))
save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[2])
"""
DETECT = """
import json, sys
path, sys.argv = sys.argv[1], ["main.py", "--cpu"]  # ComfyUI's device setup reads its flags
import comfy.options
comfy.options.enable_args_parsing()
from safetensors.torch import load_file
from comfy.model_detection import detect_unet_config
state = load_file(path)
config = detect_unet_config(state, "model.diffusion_model.")
print(json.dumps({k: v for k, v in config.items() if isinstance(v, (int, float, str, list))}))
"""


def in_comfyui(script: str, *args: str, stub: Path) -> str:
    """`script` in ComfyUI's Python, its checkout the working folder (torchvision and
    torchaudio stood in where absent, as the end-to-end tests do)."""
    stub.mkdir(exist_ok=True)
    (stub / "sitecustomize.py").write_text(MISSING_PACKAGES_STUB)
    python = os.environ.get("COMFYUI_PYTHON", "python3")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [python, "-c", script, *args],
        cwd=os.environ["COMFYUI_DIR"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("kind", ["flux1", "flux2"])
def test_comfyuis_vae_conversion_is_what_the_server_reads(tmp_path, kind):
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLFlux2

    config = dict(block_out_channels=(32, 32, 32, 32), layers_per_block=1, norm_num_groups=32)
    torch.manual_seed(0)
    if kind == "flux1":
        model = AutoencoderKL(
            latent_channels=16,
            **config,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
        )
    else:
        model = AutoencoderKLFlux2(**config)
    weights = {n: v.detach().numpy().copy() for n, v in model.state_dict().items()}
    save_file(weights, str(tmp_path / "diffusers.safetensors"))
    paths = [str(tmp_path / "diffusers.safetensors"), str(tmp_path / "comfy.safetensors")]
    in_comfyui(CONVERT, *paths, stub=tmp_path / "stub")
    comfy = load_file(str(tmp_path / "comfy.safetensors"))
    assert ldm_names.is_ldm(comfy)
    back = ldm_names.renamed(comfy)
    assert set(back) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(
            np.asarray(back[name]).reshape(value.shape), value, err_msg=name
        )
        assert back[name].shape == value.shape, name


def test_comfyuis_detection_takes_the_z_image_file(tmp_path):
    from gmlx_server.engine import file_headers
    from gmlx_server.engine.families.z_image import components

    _, models = write_comfy_models(tmp_path)
    path = models / "diffusion_models" / DIT_FILE
    detected = json.loads(in_comfyui(DETECT, str(path), stub=tmp_path / "stub").splitlines()[-1])
    told = components.dit_config(file_headers.read(path))
    assert detected["image_model"] == "lumina2"
    assert detected["n_layers"] == told["n_layers"]
    assert detected["cap_feat_dim"] == told["cap_feat_dim"]
