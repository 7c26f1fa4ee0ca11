"""A model entry's settings as the flags of the commands that load a model themselves (`gmlx
image sample` and `gmlx image bench`): one flag per key of the configuration's model entries
(but `adapters`, the commands' own `--adapter`), parsed by the configuration's own parser so a
refusal names the flag, each over the chosen model's entry; and a sample of a folder with
`--dit FILE` is the sample of the model entry that names the file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_server.config import MODEL_SETTINGS, ConfigError, ModelSettings
from gmlx_server.engine.embedded import DIFFUSERS_WEIGHTS
from gmlx_server.engine.families.qwen_image21 import embedded
from gmlx_server.engine.load_settings import LoadSettings
from gmlx_server.engine.precision import Quantization
from gmlx_server.image_cli import bench_parser, sample_parser
from gmlx_server.model_choice import choose_model
from gmlx_server.parsers import NOT_FLAGS, flag_name, model_flags
from safetensors.numpy import load_file

from tests.engine.gguf_files import write_dit

SAMPLE = ["--prompt", "x", "--out", "x.png"]
PARSERS = [(sample_parser, SAMPLE), (bench_parser, [])]


@pytest.mark.parametrize(("parser", "required"), PARSERS)
def test_every_model_entry_key_is_a_flag_described_as_the_entry_describes_it(parser, required):
    help_text = " ".join(parser().format_help().split())
    for key, description in MODEL_SETTINGS.items():
        if key in NOT_FLAGS:  # a command's own (--adapter), or the encode route's alone
            continue
        assert flag_name(key) in help_text
        assert " ".join(description.split()) in help_text, key
    assert model_flags(parser().parse_args(required)) == {}


@pytest.mark.parametrize(("parser", "required"), PARSERS)
def test_the_flags_give_a_model_entrys_table_and_refusals_name_the_flag(
    parser, required, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    Path("dit.gguf").write_bytes(b"GGUF")
    Path("notes.txt").write_text("x")
    given = ["--quantize", "5", "--encoder-vae-dtype", "bf16", "--dit", "dit.gguf"]
    args = parser().parse_args([*required, *given])
    assert model_flags(args) == {"quantize": 5, "encoder_vae_dtype": "bf16", "dit": "dit.gguf"}
    for flags, message in (
        (["--group-size", "32"], "--group-size needs --quantize (the bits)"),
        (
            ["--dit", "notes.txt"],
            f"--dit must name a .gguf or .safetensors file, not '{tmp_path}/notes.txt'",
        ),
        (["--text-encoder", "te.gguf"], f"--text-encoder: no file at '{tmp_path}/te.gguf'"),
        (["--mmproj", "vision.gguf"], f"--mmproj: no file at '{tmp_path}/vision.gguf'"),
    ):
        with pytest.raises(ConfigError) as refused:
            model_flags(parser().parse_args([*required, *flags]))
        assert str(refused.value) == message
    with pytest.raises(SystemExit):
        parser().parse_args([*required, "--encoder-vae-dtype", "f64"])
    assert "invalid choice: 'f64'" in capsys.readouterr().err


def test_the_flags_go_over_the_chosen_models_entry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = embedded.ensure_embedded_model(tmp_path / "models")
    dit = tmp_path / "dit.gguf"
    dit.write_bytes(b"GGUF")
    alone = choose_model(str(folder), flags={"dit": "dit.gguf", "encoder_vae_dtype": "f16"})
    assert alone.registry.settings(folder.name) == LoadSettings(encoder_vae_dtype="f16", dit=dit)
    config = tmp_path / "config.toml"
    config.write_text(
        f'[server]\nmodel_dirs = ["{folder.parent}"]\ndefault_model = "{folder.name}"\n'
        f'[models."{folder.name}"]\nquantize = 4\nencoder_vae_dtype = "f32"\n'
    )
    entry = choose_model(None, config, {"dit": "dit.gguf", "encoder_vae_dtype": "auto"})
    expected = LoadSettings(Quantization(4), dit=dit)
    assert entry.registry.settings(folder.name) == expected
    assert choose_model(None, config).registry.settings(folder.name) == LoadSettings(
        Quantization(4), encoder_vae_dtype="f32"
    )
    assert isinstance(ModelSettings(), LoadSettings)


def test_what_only_component_files_are_told_is_refused_for_a_folder(tmp_path, monkeypatch):
    """--family, --variant and --tokenizer tell a set of component files what its files
    cannot; a folder says its own, so each is refused naming the flag, not dropped."""
    monkeypatch.chdir(tmp_path)
    folder = embedded.ensure_embedded_model(tmp_path / "models")
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nmodel_dirs = ["{folder.parent}"]\n')
    for flags, flag in (({"family": "nope"}, "--family"), ({"variant": "base"}, "--variant")):
        for model in (str(folder), folder.name):
            with pytest.raises(ConfigError) as refused:
                choose_model(model, config, flags)
            assert str(refused.value).startswith(f"{flag} is told to a model of component files")


def gguf_folder(tmp_path: Path) -> tuple[Path, Path]:
    """The embedded model without its DiT's weights, and a GGUF file of them (the blocks'
    linears Q8_0) elsewhere."""
    source = embedded.ensure_embedded_model(tmp_path / "cache")
    folder = tmp_path / "models" / "tiny-gguf"
    shutil.copytree(source, folder)
    (folder / "transformer" / DIFFUSERS_WEIGHTS).unlink()
    weights = load_file(str(source / "transformer" / DIFFUSERS_WEIGHTS))
    types = {
        name: T.Q8_0
        for name, value in weights.items()
        if name.startswith("transformer_blocks.") and value.ndim == 2
    }
    dit = tmp_path / "gguf" / "tiny-dit-Q8_0.gguf"
    dit.parent.mkdir()
    write_dit(dit, weights, types, np.random.default_rng(0))
    return folder, dit


def sample(tmp_path: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "gmlx_server", "image", "sample", "--prompt", "a red fox"]
    command += ["--width", "64", "--height", "64", "--seed", "3", "--out", str(tmp_path / out)]
    return subprocess.run(command + list(extra), capture_output=True, text=True, env=env)


def test_a_folder_sampled_with_dit_is_the_model_entry_naming_the_file(tmp_path):
    folder, dit = gguf_folder(tmp_path)
    flagged = sample(tmp_path, "flags.png", "--model", str(folder), "--dit", str(dit))
    assert flagged.returncode == 0, flagged.stderr[-2000:]
    config = tmp_path / "config.toml"
    config.write_text(
        f'[server]\nmodel_dirs = ["{folder.parent}"]\n[models."{folder.name}"]\ndit = "{dit}"\n'
    )
    entry = sample(tmp_path, "entry.png", "--config", str(config), "--model", folder.name)
    assert entry.returncode == 0, entry.stderr[-2000:]
    assert (tmp_path / "flags.png").read_bytes() == (tmp_path / "entry.png").read_bytes()
    # without the flag the folder has no DiT weights to load
    plain = sample(tmp_path, "plain.png", "--model", str(folder))
    assert plain.returncode == 1 and not (tmp_path / "plain.png").exists()
    missing = sample(tmp_path, "x.png", "--model", str(folder), "--dit", str(tmp_path / "no.gguf"))
    assert missing.returncode == 2
    assert f"gmlx image sample: --dit: no file at '{tmp_path}/no.gguf'" in missing.stderr
