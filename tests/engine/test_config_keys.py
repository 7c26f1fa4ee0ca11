"""Every key of a family's DiT and VAE config class (diffusers' `__init__` parameters) is read by
the server's config reader, fixed to what the network builds (`FIXED`: another value refused,
naming the key), or said to change nothing the server computes (`NOT_READ`, with the reason):
engine/config_keys.py. A folder whose fixed key differs is refused at load, 400, naming it."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest
from gmlx_contract.errors import ContractError
from gmlx_server.engine.config_keys import check_fixed
from gmlx_server.engine.families.flux2_klein import layout as flux2
from gmlx_server.engine.families.flux3_klein import layout as flux3
from gmlx_server.engine.families.krea2 import layout as krea2
from gmlx_server.engine.families.qwen_image21 import layout as qwen_image21_layout
from gmlx_server.engine.families.z_image import layout as z_image
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.vaes import autoencoder_kl, autoencoder_kl_flux2, qwen_image, qwen_image21

from tests.families.z_image.tiny.folder import build_tiny_folder


class Recording(dict):
    """A config that records every key its reader asks for."""

    def __init__(self, values: dict):
        super().__init__(values)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


# diffusers class name -> (the server's reader of its config, its fixed keys, its unread keys)
CASES = {
    "ZImageTransformer2DModel": (z_image.DiTConfig.from_dict, z_image.FIXED, {}),
    "Flux2Transformer2DModel": (flux2.DiTConfig.from_dict, {}, {}),
    "Flux3Transformer2DModel": (flux3.DiTConfig.from_dict, {}, {}),
    "Krea2Transformer2DModel": (krea2.DiTConfig.from_dict, {}, {}),
    "QwenImage21Transformer2DModel": (qwen_image21_layout.DiTConfig.from_dict, {}, {}),
    "AutoencoderKL": (
        autoencoder_kl.AutoencoderKL,
        autoencoder_kl.FIXED,
        autoencoder_kl.NOT_READ,
    ),
    "AutoencoderKLFlux2": (
        autoencoder_kl_flux2.AutoencoderKLFlux2,
        autoencoder_kl.FIXED,
        autoencoder_kl_flux2.NOT_READ,
    ),
    "AutoencoderKLQwenImage": (
        qwen_image.QwenImageVAE,
        qwen_image21.FIXED,
        qwen_image21.NOT_READ,
    ),
    "AutoencoderKLQwenImage21": (
        qwen_image21.QwenImage21VAE,
        qwen_image21.FIXED,
        qwen_image21.NOT_READ,
    ),
}


# Defaults a family's checkpoints change (FLUX.2 klein has no guidance embedder).
CHECKPOINT_VALUES = {"Flux2Transformer2DModel": {"guidance_embeds": False}}


def defaults(name: str) -> dict:
    """The class's config as diffusers writes it with every default (tuples as JSON lists), as
    the family's checkpoints set it."""
    import diffusers

    parameters = inspect.signature(getattr(diffusers, name).__init__).parameters
    values = {}
    for key, parameter in parameters.items():
        if key == "self" or parameter.kind is parameter.VAR_KEYWORD:
            continue
        value = parameter.default
        values[key] = list(value) if isinstance(value, tuple) else value
    return {**values, **CHECKPOINT_VALUES.get(name, {})}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_config_key_is_read_fixed_or_said_unread(name):
    reader, fixed, unread = CASES[name]
    config = Recording(defaults(name))
    reader(config)
    left = set(config) - config.asked - set(fixed) - set(unread)
    assert not left, f"{name}: keys neither read, fixed nor said unread: {sorted(left)}"


# A value of each fixed key that the network does not build.
OTHER = {
    "qk_norm": False,
    "down_block_types": ["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
    "up_block_types": ["AttnUpDecoderBlock2D"],
    "act_fn": "gelu",
    "mid_block_add_attention": False,
    "attn_scales": [0.5],
}


@pytest.mark.parametrize(
    ("fixed", "key"),
    [
        (table, key)
        for table in (z_image.FIXED, autoencoder_kl.FIXED, qwen_image21.FIXED)
        for key in table
    ],
)
def test_another_value_of_a_fixed_key_is_refused_naming_it(fixed, key):
    with pytest.raises(ValueError, match=repr(key)):
        check_fixed({key: OTHER[key]}, fixed, "the network")
    check_fixed({}, fixed, "the network")  # absent: diffusers' default, the one built


def test_grouped_key_value_heads_on_z_image_are_refused():
    with pytest.raises(ValueError, match="'n_kv_heads'"):
        z_image.DiTConfig.from_dict({"n_heads": 30, "n_kv_heads": 10})


def test_a_folder_whose_fixed_key_differs_is_refused_at_load_naming_it(tmp_path):
    folder = tmp_path / "z-image-tiny"
    build_tiny_folder(folder)
    changed = tmp_path / "z-image-gelu"
    shutil.copytree(folder, changed)
    config = changed / "vae" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "act_fn": "gelu"}))
    registry = ModelRegistry(extra_models=[changed])
    with pytest.raises(ContractError) as refused:
        registry.acquire(changed.name)
    assert refused.value.status == 400 and "'act_fn'" in refused.value.message


DIT_CONFIGS = {
    "ZImageTransformer2DModel": z_image.DiTConfig,
    "Flux2Transformer2DModel": flux2.DiTConfig,
    "Flux3Transformer2DModel": flux3.DiTConfig,
    "Krea2Transformer2DModel": krea2.DiTConfig,
    "QwenImage21Transformer2DModel": qwen_image21_layout.DiTConfig,
}


@pytest.mark.parametrize("name", sorted(DIT_CONFIGS))
def test_a_dit_config_value_of_another_type_is_refused_naming_its_key(name):
    """Each whole-number setting given as a string or a negative number, and each other
    setting given as an object, is refused naming its key (not a TypeError deep in the load)."""
    from dataclasses import fields

    config_class = DIT_CONFIGS[name]
    config = {**defaults(name), **CHECKPOINT_VALUES.get(name, {})}
    config_class.from_dict(config)
    tried = 0
    for entry in fields(config_class):
        key = entry.metadata.get("key")
        if key is None:
            continue
        wrong = [{"a": 1}]
        if isinstance(entry.default, (int, float)) and not isinstance(entry.default, bool):
            wrong += [str(entry.default), -1]
        for value in wrong:
            with pytest.raises(ValueError, match=repr(key)):
                config_class.from_dict({**config, key: value})
            tried += 1
    assert tried > 5
