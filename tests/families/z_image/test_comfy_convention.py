"""The `comfy` convention is what ComfyUI's own Z-Image model call returns: timestep = sigma,
and ComfyUI's NextDiT (which runs at 1 - t and negates) answers dx/dsigma, sign +1. Runs only
when COMFYUI_DIR names a ComfyUI checkout that has Z-Image (0.33 or newer; COMFYUI_PYTHON its
interpreter, default this one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.z_image import family

from tests.compare import rel_l2
from tests.families.z_image.tiny.folder import build_tiny_folder
from tests.families.z_image.tiny.transformer import TINY_CONFIG

COMFY_DIR = os.environ.get("COMFYUI_DIR")


def comfy_has_z_image() -> bool:
    """Whether COMFYUI_DIR is a checkout with Z-Image (its diffusers key map for it)."""
    utils = Path(COMFY_DIR or "") / "comfy" / "utils.py"
    return utils.is_file() and "def z_image_to_diffusers" in utils.read_text()


pytestmark = pytest.mark.skipif(
    not comfy_has_z_image(), reason="COMFYUI_DIR does not name a ComfyUI checkout with Z-Image"
)

# ComfyUI sizes the time embedder from the width (min(dim, 1024) wide inside, 256 out) where
# diffusers fixes it (1024 inside, min(dim, 256) out): the two agree from a width of 1024 on,
# as at full size.
COMFY_SIZES = {"dim": 1024, "n_heads": 8, "n_kv_heads": 8, "axes_dims": (32, 48, 48)}


def test_comfy_convention_is_comfyuis_model_call(tmp_path):
    folder = tmp_path / "z-image-tiny"
    build_tiny_folder(folder, seed=2, **COMFY_SIZES)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, TINY_CONFIG["in_channels"], 6, 10)).astype(np.float32)
    cap = rng.standard_normal((1, 13, TINY_CONFIG["cap_feat_dim"])).astype(np.float32)
    sigma = np.array([0.65], np.float32)
    np.savez(tmp_path / "inputs.npz", x=x, sigma=sigma, cap=cap)
    script = Path(__file__).with_name("comfy_forward.py")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    args = [python, str(script), str(folder / "transformer"), str(tmp_path / "inputs.npz")]
    env = {**os.environ, "PYTHONPATH": COMFY_DIR}
    run = subprocess.run(
        [*args, str(tmp_path / "comfy.npy")], cwd=COMFY_DIR, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    comfy = np.load(tmp_path / "comfy.npy")

    model = family.Z_IMAGE.load(folder, folder.name)
    ours = model.denoise_step(x, sigma, [StepRow(cap, "c")], convention="comfy").out
    assert rel_l2(ours, comfy) <= 1e-4
    assert rel_l2(-ours, comfy) > 1  # the sign is what is checked
