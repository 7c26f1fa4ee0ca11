"""The precision a model loads at: a model entry's `quantize` and `group_size`, `--quantize`
and `--group-size` on `gmlx serve` and `gmlx image sample|bench`, and the registry handing it
to the family's load (refused for a family that does not quantize)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gmlx_server import cli
from gmlx_server.config import ConfigError, load_config, model_settings_over
from gmlx_server.engine.load_settings import LoadSettings
from gmlx_server.engine.precision import Quantization
from gmlx_server.image_cli import bench_parser, sample_parser
from gmlx_server.parsers import model_flags, quantization_argument

from tests.server import linear_family
from tests.server.conftest import config_file, linear_registry, refused_load


def test_entries_name_their_precision_and_the_flag_overrides_them(tmp_path):
    path = config_file(
        tmp_path,
        '[models."a"]\nquantize = 4\n[models."b"]\nquantize = 8\ngroup_size = 128\n'
        '[models."c"]\nadapters = []\n',
    )
    config = load_config(path, env={})
    assert config.load_settings_for("a").quantization == Quantization(4, 64)
    assert config.load_settings_for("b").quantization == Quantization(8, 128)
    assert config.load_settings_for("c").quantization is None
    assert config.load_settings_for("absent").quantization is None
    flagged = load_config(path, env={}, quantization=Quantization(3, 32))
    assert {flagged.load_settings_for(m).quantization for m in "abc"} == {Quantization(3, 32)}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("quantize = 2", "quantize must be one of 3, 4, 5, 6, 8 bits, not 2"),
        ("quantize = 16", "quantize must be one of 3, 4, 5, 6, 8 bits, not 16"),
        ('quantize = "4"', "config key 'quantize' must be an integer, not '4'"),
        ("quantize = true", "config key 'quantize' must be an integer, not True"),
        ("quantize = 4\ngroup_size = 48", "group_size must be one of 32, 64, 128, not 48"),
        ("group_size = 32", "group_size needs quantize"),
        (
            "bits = 4",
            "unknown setting 'bits' (known: adapters, quantize, group_size, encoder_vae_dtype,"
            " dit, text_encoder, mmproj, vae, family, variant, tokenizer, prompt_upsampler,"
            " prompt_upsampling)",
        ),
    ],
)
def test_bad_precisions_are_refused_naming_the_entry(tmp_path, entry, message):
    path = config_file(tmp_path, f'[models."m1"]\n{entry}\n')
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    assert "[models.'m1']" in str(refused.value) and message in str(refused.value)


@pytest.mark.parametrize(
    ("parser", "required"),
    [(sample_parser, ["--prompt", "x", "--out", "x.png"]), (bench_parser, [])],
)
def test_the_image_commands_take_quantize_and_group_size(parser, required, capsys):
    args = parser().parse_args([*required, "--quantize", "5"])
    assert model_settings_over(None, model_flags(args), Path()).quantization == Quantization(5)
    assert model_flags(parser().parse_args(required)) == {}
    args = parser().parse_args([*required, "--group-size", "32"])
    with pytest.raises(ValueError, match="--group-size needs --quantize"):
        model_flags(args)
    with pytest.raises(SystemExit):
        parser().parse_args([*required, "--quantize", "7"])
    assert "invalid choice: 7" in capsys.readouterr().err


def test_serve_takes_quantize_and_group_size():
    args = cli.build_parser().parse_args(["serve", "--quantize", "4", "--group-size", "128"])
    assert quantization_argument(args) == Quantization(4, 128)


def test_serve_refuses_a_group_size_without_bits(tmp_path):
    command = [sys.executable, "-m", "gmlx_server", "serve", "--group-size", "64"]
    command += ["--config", str(config_file(tmp_path, ""))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "gmlx serve: --group-size needs --quantize" in result.stderr


def test_a_family_that_does_not_quantize_is_refused_before_anything_loads(tmp_path):
    folder = linear_family.make_model_folder(tmp_path, "lin")
    message = refused_load(folder, LoadSettings(Quantization(4)))
    assert "family test_linear does not quantize its weights" in message
    assert linear_registry(folder, LoadSettings()).acquire("lin").model_id == "lin"


def test_an_entrys_dit_names_an_existing_gguf_file_beside_the_config(tmp_path):
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "dit-Q4_K_M.gguf").write_bytes(b"GGUF")
    path = config_file(tmp_path, '[models."a"]\ndit = "gguf/dit-Q4_K_M.gguf"\n')
    config = load_config(path, env={})
    assert config.load_settings_for("a").files() == {"dit": tmp_path / "gguf" / "dit-Q4_K_M.gguf"}
    assert config.load_settings_for("absent").files() == {}
    for entry, message in (
        ('dit = "gguf/missing.gguf"', "dit: no file at"),
        ('dit = "config.toml"', "dit must name a .gguf or .safetensors file"),
        ('text_encoder = "config.toml"', "text_encoder must name a .gguf or .safetensors file"),
        ("dit = 4", "config key 'dit' must be a string, not 4"),
    ):
        path = config_file(tmp_path, f'[models."m1"]\n{entry}\n')
        with pytest.raises(ConfigError, match=message):
            load_config(path, env={})


def test_a_family_that_reads_no_gguf_refuses_a_dit_setting(tmp_path):
    folder = linear_family.make_model_folder(tmp_path, "lin")
    message = refused_load(folder, LoadSettings(dit=tmp_path / "dit.gguf"))
    assert "family test_linear reads no GGUF file for its dit" in message
