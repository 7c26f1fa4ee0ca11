"""Loading a vae/ folder, the attributes the engine reads of a VAE (engine/family.py), and refusals
of bad input."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE
from safetensors.numpy import load_file, save_file

from tests.compare import rel_l2

WEIGHTS = "diffusion_pytorch_model.safetensors"


def test_attributes(rgba_vae):
    directory, model = rgba_vae
    vae = QwenImage21VAE.load(directory)
    assert (vae.z_dim, vae.in_channels, vae.out_channels, vae.stride) == (16, 4, 4, 16)
    tensors = load_file(str(directory / WEIGHTS))
    # Everything but the temporal convs, which a single frame never reaches.
    held = sum(t.nbytes for name, t in tensors.items() if ".time_conv." not in name)
    assert vae.weight_bytes == held
    assert any(".time_conv." in name for name in tensors)


def _copy(directory, tmp_path):
    target = tmp_path / "vae"
    shutil.copytree(directory, target)
    return target


def test_missing_weight_is_named(rgba_vae, tmp_path):
    target = _copy(rgba_vae[0], tmp_path)
    tensors = load_file(str(target / WEIGHTS))
    del tensors["decoder.up_blocks.1.upsampler.resample.1.weight"]
    save_file(tensors, str(target / WEIGHTS))
    with pytest.raises(ValueError, match="up_blocks.1.upsampler.resample_conv.weight"):
        QwenImage21VAE.load(target)


def test_wrong_shape_is_refused(rgba_vae, tmp_path):
    target = _copy(rgba_vae[0], tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["base_dim"] = 16
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match"):
        QwenImage21VAE.load(target)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    # is_residual false is the plain layout (vaes/qwen_image.py's): a residual file's weights
    # do not match it
    [("is_residual", False, "do not match"), ("patch_size", 2, "patch_size")],
)
def test_unsupported_designs_are_refused(rgba_vae, tmp_path, key, value, message):
    target = _copy(rgba_vae[0], tmp_path)
    config = json.loads((target / "config.json").read_text())
    config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        QwenImage21VAE.load(target)


def test_rgb_input_gets_an_opaque_alpha(rgba_vae):
    vae = QwenImage21VAE.load(rgba_vae[0])
    rgb = np.random.default_rng(31).random((1, 32, 48, 3), dtype=np.float32)
    rgba = np.concatenate([rgb, np.ones((1, 32, 48, 1), np.float32)], axis=-1)
    got = np.array(vae.encode(mx.array(rgb)))
    assert rel_l2(got, np.array(vae.encode(mx.array(rgba)))) == 0.0


def test_extra_channels_are_dropped(tiny_vae):
    vae = QwenImage21VAE.load(tiny_vae[0])
    image = np.random.default_rng(32).random((1, 16, 32, 5), dtype=np.float32)
    got = np.array(vae.encode(mx.array(image)))
    expected = np.array(vae.encode(mx.array(image[..., : vae.in_channels])))
    assert rel_l2(got, expected) == 0.0


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 24, 32, 4), "multiple of the VAE stride"),
        ((1, 16, 16, 2), "channels"),
        ((16, 16, 4), "B, H, W, C"),
    ],
)
def test_bad_images_are_refused(rgba_vae, shape, message):
    vae = QwenImage21VAE.load(rgba_vae[0])
    with pytest.raises(EngineInputError, match=message):
        vae.encode(mx.zeros(shape))


@pytest.mark.parametrize("shape", [(1, 8, 2, 2), (16, 2, 2)])
def test_bad_latents_are_refused(rgba_vae, shape):
    vae = QwenImage21VAE.load(rgba_vae[0])
    with pytest.raises(EngineInputError, match="latents are"):
        vae.decode(mx.zeros(shape))
