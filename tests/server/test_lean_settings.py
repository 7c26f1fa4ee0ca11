"""The lean-memory settings: a model entry's `encoder_vae_dtype` (the text encoder's and the
VAE's compute dtype) and `[server.image] encoder_residency`, checked as they are read, and the
registry handing the dtype to the family's load (refused for a family that cannot take it)."""

from __future__ import annotations

import pytest
from gmlx_server.config import ConfigError, load_config
from gmlx_server.engine.load_settings import LoadSettings

from tests.server import linear_family
from tests.server.conftest import config_file, linear_registry, refused_load


def test_the_dtype_and_the_residency_are_read_and_default_to_auto(tmp_path):
    path = config_file(
        tmp_path,
        '[server.image]\nencoder_residency = "release"\n'
        '[models."a"]\nencoder_vae_dtype = "f32"\n[models."b"]\nquantize = 4\n',
    )
    config = load_config(path, env={})
    assert config.image.encoder_residency == "release"
    assert config.load_settings_for("a").encoder_vae_dtype == "f32"
    assert config.load_settings_for("b").encoder_vae_dtype == "auto"
    assert config.load_settings_for("absent").encoder_vae_dtype == "auto"
    assert load_config(config_file(tmp_path, ""), env={}).image.encoder_residency == "auto"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[models."a"]\nencoder_vae_dtype = "f64"\n',
            '[models.\'a\']: encoder_vae_dtype must be one of "auto", "f32", "bf16", "f16",'
            " not 'f64'",
        ),
        (
            '[models."a"]\nencoder_vae_dtype = 32\n',
            "config key 'encoder_vae_dtype' must be a string, not 32",
        ),
        (
            '[server.image]\nencoder_residency = "never"\n',
            'server.image: encoder_residency must be one of "keep", "release", "auto", not'
            " 'never'",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as refused:
        load_config(config_file(tmp_path, text), env={})
    assert message in str(refused.value)


def test_a_family_without_the_setting_is_refused_and_auto_asks_nothing(tmp_path):
    folder = linear_family.make_model_folder(tmp_path, "lin")
    message = refused_load(folder, LoadSettings(encoder_vae_dtype="bf16"))
    assert "family test_linear has no encoder and VAE dtype to set" in message
    assert linear_registry(folder, LoadSettings()).acquire("lin").model_id == "lin"
