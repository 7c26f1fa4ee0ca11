"""The wrappers of stock ComfyUI functions (stock.py), on stand-ins of those functions with
their signatures: ComfyUI 0.3.64's and current ones (which pass the latent's stride)."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from gmlx_comfy import stock
from gmlx_comfy.errors import GmlxError


def _lora_keys_0_3_64(model, key_map={}):  # noqa: B006 - ComfyUI's own signature
    for k in model.state_dict():
        key_map[k.removesuffix(".weight")] = k
    return key_map


def _fix_empty_0_3_64(model, latent_image):
    channels = model.get_model_object("latent_format").latent_channels
    if latent_image.shape[1] != channels and torch.count_nonzero(latent_image) == 0:
        latent_image = latent_image[:, :1].repeat(1, channels, 1, 1)
    return latent_image


def _fix_empty_current(model, latent_image, downscale_ratio_spacial=None, temporal=None):
    latent_format = model.get_model_object("latent_format")
    latent_image = _fix_empty_0_3_64(model, latent_image)
    if downscale_ratio_spacial is not None and torch.count_nonzero(latent_image) == 0:
        ratio = downscale_ratio_spacial / latent_format.spacial_downscale_ratio
        size = (round(latent_image.shape[-2] * ratio), round(latent_image.shape[-1] * ratio))
        latent_image = torch.nn.functional.interpolate(latent_image, size=size)
    return latent_image


def _modules(fix_empty=_fix_empty_0_3_64):
    lora = types.SimpleNamespace(model_lora_keys_unet=_lora_keys_0_3_64)
    sample = types.SimpleNamespace(fix_empty_latent_channels=fix_empty)
    stock.install(lora, sample)
    return lora, sample


class _Model:
    def __init__(self, keys, gmlx_keys=None):
        self.keys = keys
        if gmlx_keys is not None:
            self.gmlx_lora_keys = gmlx_keys

    def state_dict(self):
        return dict.fromkeys(self.keys)


class _Patcher:
    def __init__(self, channels, stride=None):
        self.latent_format = types.SimpleNamespace(
            latent_channels=channels, spacial_downscale_ratio=stride or 8
        )
        if stride is not None:
            self.latent_format.gmlx_stride = stride

    def get_model_object(self, name):
        assert name == "latent_format"
        return self.latent_format


def test_install_wraps_once_and_keeps_the_original_behaviour():
    lora, sample = _modules()
    wrapped = lora.model_lora_keys_unet
    stock.install(lora, sample)
    assert lora.model_lora_keys_unet is wrapped and wrapped.__wrapped__ is _lora_keys_0_3_64
    plain = _Model(["diffusion_model.a.weight"])
    assert lora.model_lora_keys_unet(plain, {}) == {"diffusion_model.a": "diffusion_model.a.weight"}


def test_a_gmlx_model_adds_its_forms_without_overriding_comfys():
    lora, _ = _modules()
    model = _Model(
        ["diffusion_model.a.weight"],
        gmlx_keys={"transformer.a": "diffusion_model.a.weight", "diffusion_model.a": "other"},
    )
    key_map = lora.model_lora_keys_unet(model, {})
    assert key_map == {
        "diffusion_model.a": "diffusion_model.a.weight",
        "transformer.a": "diffusion_model.a.weight",
    }


def test_a_gmlx_key_replaces_comfys_where_that_lands_on_no_weight_of_the_model():
    """ComfyUI's Lumina2 maps diffusers keys onto its own fused qkv, which the model lacks."""

    def comfy_lumina2(model, key_map={}):  # noqa: B006 - ComfyUI's own signature
        key_map = _lora_keys_0_3_64(model, key_map)
        key_map["transformer.a.to_q"] = ("diffusion_model.a.qkv.weight", (0, 0, 4))
        return key_map

    lora = types.SimpleNamespace(model_lora_keys_unet=comfy_lumina2)
    stock.install(lora, types.SimpleNamespace(fix_empty_latent_channels=_fix_empty_0_3_64))
    model = _Model(
        ["diffusion_model.a.to_q.weight"],
        gmlx_keys={"transformer.a.to_q": "diffusion_model.a.to_q.weight"},
    )
    key_map = lora.model_lora_keys_unet(model, {})
    assert key_map["transformer.a.to_q"] == "diffusion_model.a.to_q.weight"


def test_0_3_64_stock_empty_latents_fit_a_model_of_stride_8():
    _, sample = _modules(_fix_empty_0_3_64)
    fixed = sample.fix_empty_latent_channels(_Patcher(16, 8), torch.zeros(1, 4, 32, 32))
    assert fixed.shape == (1, 16, 32, 32)


def test_0_3_64_stock_empty_latents_are_refused_naming_the_node():
    _, sample = _modules(_fix_empty_0_3_64)
    for channels in (4, 16):  # EmptyLatentImage, EmptySD3LatentImage at 256²
        with pytest.raises(GmlxError, match="gmlx Empty Latent") as err:
            sample.fix_empty_latent_channels(_Patcher(64, 16), torch.zeros(1, channels, 32, 32))
        assert "2 times" in str(err.value)


def test_0_3_64_latents_of_the_model_and_other_models_pass():
    _, sample = _modules(_fix_empty_0_3_64)
    ours = torch.zeros(1, 64, 16, 16)  # gmlx Empty Latent
    assert sample.fix_empty_latent_channels(_Patcher(64, 16), ours) is ours
    encoded = torch.ones(1, 4, 32, 32)  # not empty: not an empty latent's business
    assert sample.fix_empty_latent_channels(_Patcher(64, 16), encoded) is encoded
    stock_model = sample.fix_empty_latent_channels(_Patcher(16), torch.zeros(1, 4, 32, 32))
    assert stock_model.shape == (1, 16, 32, 32)


def test_current_stock_empty_latents_take_the_models_stride(caplog):
    _, sample = _modules(_fix_empty_current)
    with caplog.at_level(logging.WARNING, "gmlx_comfy"):
        fixed = sample.fix_empty_latent_channels(_Patcher(64, 16), torch.zeros(1, 4, 32, 32), 8)
    assert fixed.shape == (1, 64, 16, 16) and not caplog.records  # 256² stays 256²
    with caplog.at_level(logging.WARNING, "gmlx_comfy"):
        odd = sample.fix_empty_latent_channels(_Patcher(64, 16), torch.zeros(1, 4, 65, 63), 8)
    assert odd.shape[-2:] == (32, 32)
    (record,) = caplog.records
    assert "504×520 pixels samples at 512×512" in record.getMessage()
