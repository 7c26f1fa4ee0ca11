"""Config precedence and validation, the command line, and `gmlx serve` as a real process that
stops cleanly on SIGTERM and SIGINT."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
from gmlx_server import cli, process, server_records
from gmlx_server.config import (
    ENVIRONMENT,
    AdapterSpec,
    ConfigError,
    ModelSettings,
    ServerConfig,
    is_loopback_host,
    load_config,
)

CONFIG = """
[server]
host = "127.0.0.2"
port = 9000
api_key = "file-key"
model_dirs = ["~/models-a", "/srv/models-b"]
default_model = "m1"
threads = 6

[server.image]
tensor_cache_mb = 32
adapter_cache_mb = 128
steps_api = false
steps_remote = true
run_idle_s = 2
run_sweep_s = 0.5
"""


def test_defaults_without_a_file(tmp_path):
    config = load_config(None, env={"HOME": str(tmp_path)})
    assert (config.host, config.port, config.api_key) == ("127.0.0.1", 8080, None)
    assert config.model_dirs == [] and config.default_model is None and config.threads == 8
    image = config.image
    assert (image.tensor_cache_mb, image.adapter_cache_mb) == (64, 256)
    assert (image.steps_api, image.steps_remote) == (True, False)
    assert (image.run_idle_s, image.run_sweep_s) == (120.0, 5.0)


def test_file_then_env_then_flags(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(CONFIG)
    config = load_config(path, env={})
    assert (config.host, config.port, config.api_key, config.default_model) == (
        "127.0.0.2",
        9000,
        "file-key",
        "m1",
    )
    assert config.model_dirs == [Path("~/models-a").expanduser(), Path("/srv/models-b")]
    assert config.image.steps_api is False and config.image.steps_remote is True
    assert (config.image.run_idle_s, config.image.run_sweep_s) == (2.0, 0.5)
    assert config.source == path
    env = {
        "GMLX_HOST": "127.0.0.3",
        "GMLX_PORT": "9100",
        "GMLX_API_KEY": "env-key",
        "GMLX_MODEL_DIRS": os.pathsep.join(["/x", "/y"]),
        "GMLX_DEFAULT_MODEL": "m2",
    }
    config = load_config(path, env=env)
    assert (config.host, config.port, config.api_key, config.default_model) == (
        "127.0.0.3",
        9100,
        "env-key",
        "m2",
    )
    assert config.model_dirs == [Path("/x"), Path("/y")]
    config = load_config(path, env=env, host="::1", port=9200)
    assert (config.host, config.port) == ("::1", 9200)


@pytest.mark.parametrize(
    "text",
    [
        "[server]\nport = 'x'",
        "[server]\nport = true",
        "[server]\nport = 70000",
        "[server]\nmodel_dirs = 'one'",
        "[server.image]\ntensor_cache_mb = 0",
        "[server.image]\nsteps_api = 1",
        "[server]\nthreads = 1",
        "[server]\nthreads = 100000",  # Waitress would start every one before answering
        "[server.image]\nrun_sweep_s = 0",
        "[server.image]\nimage_url_ttl_s = nan",
        "server = 3",
        "not toml [",
    ],
)
def test_bad_files_are_refused(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    assert str(path) in str(refused.value), refused.value  # the file is named, ranges too
    key = text.split("\n")[-1].split(" =")[0]
    if "\n" in text and key.isidentifier():  # a setting's value: named alone
        assert key in str(refused.value) and " and " not in str(refused.value), refused.value


@pytest.mark.parametrize("value", ["70000", "-1"])
def test_a_port_out_of_range_in_the_environment_is_named_as_the_variable(value):
    with pytest.raises(ConfigError, match=f"GMLX_PORT must be from 0 to 65535, not {value}"):
        load_config(None, env={"GMLX_PORT": value})


def test_model_entries_name_their_adapters(tmp_path):
    (tmp_path / "style.safetensors").write_bytes(b"")
    (tmp_path / "odd:name.safetensors").write_bytes(b"")
    path = tmp_path / "c.toml"
    path.write_text(
        '[models."qwen-image-2.1"]\n'
        f'adapters = ["{tmp_path}/style.safetensors:0.8", "{tmp_path}/odd:name.safetensors"]\n'
        "[models.other]\n"
    )
    config = load_config(path, env={})
    assert config.models["qwen-image-2.1"].adapters == (
        AdapterSpec(tmp_path / "style.safetensors", 0.8),
        AdapterSpec(tmp_path / "odd:name.safetensors", 1.0),
    )
    assert config.models["other"].adapters == ()


def test_relative_adapter_paths_are_under_the_config_files_folder(tmp_path, monkeypatch):
    (tmp_path / "loras").mkdir()
    (tmp_path / "loras" / "style.safetensors").write_bytes(b"")
    (tmp_path / "c.toml").write_text('[models.m]\nadapters = ["loras/style.safetensors:0.5"]\n')
    monkeypatch.chdir(tmp_path / "loras")
    config = load_config(tmp_path / "c.toml", env={})
    assert config.models["m"].adapters == (
        AdapterSpec(tmp_path / "loras" / "style.safetensors", 0.5),
    )


def test_a_model_folder_hidden_by_another_of_its_name_is_said_at_start(tmp_path, caplog):
    from gmlx_server.engine.registry import ModelRegistry

    for root in ("first", "second"):
        (tmp_path / root / "m").mkdir(parents=True)
        (tmp_path / root / "m" / "model_index.json").write_text("{}")
    registry = ModelRegistry([tmp_path / "first", tmp_path / "second"])
    assert registry.folders()["m"] == tmp_path / "first" / "m"
    with caplog.at_level("WARNING", logger="gmlx.server"):
        cli._warn_of_model_folders(registry)
    assert caplog.messages == [
        f"model 'm' is served from {tmp_path / 'first' / 'm'}; {tmp_path / 'second' / 'm'},"
        " of the same name, is not"
    ]


def test_relative_model_folders_are_under_the_config_files_folder(tmp_path, monkeypatch):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "c.toml").write_text(
        '[server]\nmodel_dirs = ["../models", "/abs"]\ncomfyui_model_dirs = ["comfy"]\n'
    )
    monkeypatch.chdir("/")
    config = load_config(tmp_path / "etc" / "c.toml", env={})
    assert config.model_dirs == [tmp_path / "etc" / ".." / "models", Path("/abs")]
    assert config.comfyui_model_dirs == [tmp_path / "etc" / "comfy"]
    from_env = load_config(tmp_path / "etc" / "c.toml", env={"GMLX_MODEL_DIRS": "here"})
    assert from_env.model_dirs == [Path("here")]  # the environment's: the working folder's


def test_an_entrys_prompt_upsampler_is_a_folder_under_the_config_files(tmp_path):
    (tmp_path / "pup").mkdir()
    (tmp_path / "pup" / "config.json").write_text("{}")
    (tmp_path / "c.toml").write_text(
        '[models.m]\nprompt_upsampler = "pup"\nprompt_upsampling = true\n'
    )
    entry = load_config(tmp_path / "c.toml", env={}).models["m"]
    assert (entry.prompt_upsampler, entry.prompt_upsampling) == (tmp_path / "pup", True)


def test_entries_naming_no_model_folder_are_warned_about(tmp_path, caplog):
    (tmp_path / "models" / "here").mkdir(parents=True)
    (tmp_path / "models" / "here" / "model_index.json").write_text("{}")
    config = ServerConfig(model_dirs=[tmp_path / "models"], default_model="here")
    config.models = {"here": ModelSettings(), "elsewhere": ModelSettings()}
    with caplog.at_level("WARNING"):
        registry, _ = cli.config_registry(config)
    assert registry.default_model == "here" and registry.load_hooks is not None
    assert "no model folder or servable files (yet): elsewhere" in caplog.text
    assert "here," not in caplog.text
    config.comfyui_model_dirs = [tmp_path / "comfy"]
    assert cli.model_sources(config, []) == [
        str(tmp_path / "models"),
        f"ComfyUI's {tmp_path / 'comfy'}",
        "2 model entries",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[models.m]\nadapters = ["/nowhere/x.safetensors:0.5"]', "no LoRA file"),
        ("[models.m]\nadapters = 'x.safetensors'", "list of"),
        ("[models.m]\nadapter = []", "unknown setting 'adapter'"),
        ('[models.m]\nadapters = ["c.toml:nan"]', "finite"),
        ("[models]\nm = 3", "must be a table"),
        ('[models.m]\nprompt_upsampler = "/nowhere"', "no chat model folder"),
        ("[models.m]\nprompt_upsampling = true", "prompt_upsampling needs prompt_upsampler"),
        ('[models.m]\nprompt_upsampling = "yes"', "must be true or false, not 'yes'"),
        ('[server]\nport = "8080"', "config key 'port' must be an integer, not '8080'"),
        ("[server]\nhost = 1", "config key 'host' must be a string, not 1"),
        ("[server.image]\nsteps_remote = 1", "config key 'steps_remote' must be true or false"),
        ('[server.image]\nrun_idle_s = "5"', "config key 'run_idle_s' must be a number"),
    ],
)
def test_bad_settings_and_model_entries_are_refused_by_name(tmp_path, text, message):
    assert message in refusal(tmp_path, text)


def refusal(tmp_path: Path, text: str) -> str:
    """The ConfigError's message for a config file of `text`, after the file's own name."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    message = str(refused.value)
    assert message.startswith(f"{path}: "), message  # every refusal names the file
    return message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[server]\nmodel_dir = ["~/models"]',
            "[server]: unknown setting 'model_dir': did you mean 'model_dirs'?",
        ),
        (
            '[server]\ndefualt_model = "m"',
            "unknown setting 'defualt_model': did you mean 'default_model'?",
        ),
        (
            "[server.image]\nmemory_headroom = 4096",
            "[server.image]: unknown setting 'memory_headroom': did you mean 'memory_headroom_mb'?",
        ),
        ("[sever]\nport = 9000", "unknown table 'sever': did you mean 'server'?"),
        (
            "[models.m]\nquantise = 4",
            "[models.'m']: unknown setting 'quantise': did you mean 'quantize'?",
        ),
        ("[server]\ncolour = 1", "[server]: unknown setting 'colour' (known: host, port,"),
        # a setting of another table: where it belongs
        ("port = 8099", "unknown table 'port': it is a setting of [server]"),
        (
            "tensor_cache_mb = 8",
            "unknown table 'tensor_cache_mb': it is a setting of [server.image]",
        ),
        (
            "[server]\nmemory_headroom_mb = 100",
            "[server]: unknown setting 'memory_headroom_mb': it is a setting of [server.image]",
        ),
        (
            "[server.image]\nport = 1",
            "[server.image]: unknown setting 'port': it is a setting of [server]",
        ),
        ("[server]\nimage = 5", "[server.image] must be a table"),
        (
            "[image]\nsteps_api = true",
            "unknown table 'image': it is a setting of [server], as the table [server.image]",
        ),
    ],
)
def test_unknown_keys_and_tables_are_refused_naming_the_nearest(tmp_path, text, message):
    assert message in refusal(tmp_path, text)


def test_an_environment_variable_naming_no_setting_is_refused():
    with pytest.raises(ConfigError, match="GMLX_PROT names no setting: did you mean 'GMLX_PORT'"):
        load_config(None, env={"GMLX_PROT": "9000"})
    assert load_config(None, env={"GMLX_LOG_LEVEL": "DEBUG", "OTHER_PROT": "1"}).port == 8080


def test_a_mistyped_gguf_weights_setting_is_refused():
    with pytest.raises(
        ConfigError, match="GMLX_GGUF_WEIGHTS must be blocks or affine, not 'afine'"
    ):
        load_config(None, env={"GMLX_GGUF_WEIGHTS": "afine"})
    load_config(None, env={"GMLX_GGUF_WEIGHTS": "affine"})


def test_every_gmlx_variable_the_project_reads_is_known():
    root = Path(__file__).resolve().parents[2]
    named = set()
    for folder in ("server", "comfy_nodes", "shared", "tests", "docs"):
        for path in (root / folder).rglob("*"):
            if path.suffix in (".py", ".md"):
                named |= set(re.findall(r"\bGMLX_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    assert named - {"GMLX_PROT"} <= set(ENVIRONMENT), sorted(named - set(ENVIRONMENT))


def test_a_mistyped_configuration_stops_list_and_serve(tmp_path, capsys):
    path = tmp_path / "typo.toml"
    path.write_text('[server]\nmodel_dir = ["~/models"]\n')
    for command in (["list"], ["serve"]):
        assert cli.main([*command, "--config", str(path)]) == 2
        assert "did you mean 'model_dirs'?" in capsys.readouterr().err


def test_a_named_file_must_exist(tmp_path):
    with pytest.raises(ConfigError):
        load_config(tmp_path / "absent.toml", env={})
    with pytest.raises(ConfigError):
        load_config(None, env={"GMLX_PORT": "eighty"})


@pytest.mark.parametrize("key", ["k2\n", " padded ", " "])
def test_a_key_no_header_can_carry_is_refused_at_start(tmp_path, key):
    with pytest.raises(ConfigError, match="begins or ends with white space"):
        load_config(None, env={"GMLX_API_KEY": key})
    config = tmp_path / "config.toml"
    config.write_text(f"[server]\napi_key = {key!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match="begins or ends with white space"):
        load_config(config, env={})


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("GMLX_LOG_LEVEL", "LOUD", "GMLX_LOG_LEVEL must be one of DEBUG, INFO, WARNING"),
        ("GMLX_DIT_COMPILE", "maybe", "GMLX_DIT_COMPILE must be one of 0, 1, not 'maybe'"),
        ("GMLX_BLAS", "/nowhere/libblas.so", "GMLX_BLAS=/nowhere/libblas.so: cannot load it"),
    ],
)
def test_a_bad_environment_value_stops_serve_on_one_line(tmp_path, name, value, message):
    env = {**os.environ, name: value}
    (tmp_path / "config.toml").write_text("[server]\n")
    command = [
        sys.executable,
        "-m",
        "gmlx_server",
        "serve",
        "--config",
        str(tmp_path / "config.toml"),
    ]
    result = subprocess.run(command + ["--port", "0"], capture_output=True, text=True, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "words",
    [
        ["image", "sample", "--prompt", "a", "--out", "OUT/a.png"],
        ["model", "quantize", "--bits", "4", "m", "OUT/q"],
        ["pull", "--quantize", "4", "owner/name", "--to", "OUT/p"],
    ],
)
def test_a_blas_that_cannot_load_stops_the_other_mlx_commands_on_one_line(tmp_path, words):
    env = {**os.environ, "GMLX_BLAS": "/nowhere/libblas.so"}
    command = [
        sys.executable,
        "-m",
        "gmlx_server",
        *(w.replace("OUT", str(tmp_path)) for w in words),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "GMLX_BLAS=/nowhere/libblas.so: cannot load it" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_image_store_folder_that_cannot_be_made_is_refused_at_start(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    config = tmp_path / "config.toml"
    for folder, words in ((afile, "is a file, not a folder"), (afile / "sub", "is a file")):
        config.write_text(f'[server.image]\nimage_url_dir = "{folder}"\n')
        with pytest.raises(ConfigError, match=f"server.image.image_url_dir {folder}: .*{words}"):
            load_config(config, env={}).check_startable()
    config.write_text(f'[server.image]\nimage_url_dir = "{tmp_path / "new" / "urls"}"\n')
    load_config(config, env={}).check_startable()  # made at its first use


def test_non_loopback_bind_needs_a_key():
    ServerConfig(host="127.0.0.1").check_startable()
    ServerConfig(host="0.0.0.0", api_key="k").check_startable()
    ServerConfig(host="*", api_key="k").check_startable()  # Waitress: every address
    ServerConfig(host="[::1]").check_startable()
    with pytest.raises(ConfigError, match="api_key"):
        ServerConfig(host="0.0.0.0").check_startable()
    assert cli.main(["serve", "--host", "0.0.0.0", "--config", "/dev/null"]) == 2


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.9.9.9", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example.com", False),
    ],
)
def test_is_loopback_host(host, loopback):
    assert is_loopback_host(host) is loopback


def test_parser_lists_serve_and_delegated_commands(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--port", "1234"])
    assert args.func is cli.serve and args.port == 1234 and args.host is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "serve" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["image", "sample", "--prompt", "x", "--out", "o.png", "--widht", "512"], "--width"),
        (["image", "sample", "--promt", "x", "--out", "o.png"], "--prompt"),
        (["serve", "--prot", "9"], "--port"),
    ],
)
def test_a_mistyped_option_is_named_with_the_nearest_one(capsys, argv, hint):
    with pytest.raises(SystemExit) as stopped:
        cli.build_parser().parse_args(argv)
    assert stopped.value.code == 2
    mistyped = next(a for a in argv if a.startswith("--") and a not in ("--prompt", "--out"))
    err = capsys.readouterr().err
    assert f"{mistyped} is no option here: did you mean {hint}?" in err, err


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["serve", "--zzzz"], "unrecognized arguments: --zzzz"),
        # an abbreviation argparse takes is no typo; the error is another's
        (["image", "sample", "--prompt", "x", "--out", "o", "--wid", "5", "--steps", "x"], "'x'"),
        # near the top level's --version, which this command does not take
        (["image", "sample", "--prompt", "x", "--out", "o", "--verison"], "--verison"),
    ],
)
def test_an_option_near_none_the_command_takes_is_refused_as_argparse_does(capsys, argv, refusal):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert refusal in err and "did you mean" not in err, err


@pytest.mark.parametrize("command", [["image", "sample", "--out", "x.png"], ["list"]])
def test_a_config_the_commands_cannot_read_exits_2_naming_it(tmp_path, capsys, command):
    config = tmp_path / "c.toml"
    config.write_text('[server]\nport = "8080"\n')
    argv = [*command, "--config", str(config)] + (["--prompt", "x"] if "image" in command else [])
    assert cli.main(argv) == 2
    assert f"{config}: config key 'port' must be an integer" in capsys.readouterr().err


def test_commands_are_easy_to_add(monkeypatch):
    seen = []

    def register(subparsers):
        p = subparsers.add_parser("hello")
        p.set_defaults(func=lambda args: seen.append("hi") or 3)

    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, register])
    monkeypatch.setattr(
        cli, "DELEGATED", [*cli.DELEGATED, (("tool", "echo"), "builtins:list", "echo words")]
    )
    assert cli.main(["hello"]) == 3 and seen == ["hi"]
    # a delegated command receives everything after its words
    parser = cli.build_parser()
    args = parser.parse_args(["tool", "echo", "a b"])
    assert args.func(args) == ["a b"]


def test_delegated_commands_take_dash_arguments(monkeypatch):
    monkeypatch.setattr(cli, "DELEGATED", [(("tool", "count"), "builtins:len", "count words")])
    assert cli.main(["tool", "count", "--comfy", "DIR", "-x"]) == 3


def test_tune_malloc_runs():
    assert process.tune_malloc() in (True, False)


# ---------------------------------------------------------------- gmlx serve as a process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            time.sleep(0.1)
    raise AssertionError("the server never became healthy")


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str]) -> Iterator[tuple[subprocess.Popen, str]]:
    """`gmlx serve *args` on a free loopback port, once healthy: (the process, its base URL).
    A process still running when the block ends is killed."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gmlx_server", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/health", process)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_and_stops_cleanly(tmp_path, signum):
    models = tmp_path / "models"
    models.mkdir()
    config = tmp_path / "config.toml"
    unmounted = tmp_path / "unmounted"
    config.write_text(
        f'[server]\nmodel_dirs = ["{models}", "{unmounted}"]\ndefault_model = "none-yet"\n'
        "[server.image]\nmemory_headroom_mb = 999999999\n"
    )
    env = {**os.environ, "GMLX_BLAS": "off", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    records = tmp_path / "cache" / "gmlx-steps" / server_records.FOLDER
    with serving(["--config", str(config)], env) as (process, url):
        base = url + "/internal/image-steps/v1"
        r = requests.get(base + "/models", headers={"X-Gmlx-Steps-Contract": "1.0"}, timeout=5)
        assert r.json() == {"models": [], "default_model": "none-yet"}
        record = json.loads((records / f"{process.pid}.json").read_text())
        assert record["url"] == url and record["config"] == str(config)
        process.send_signal(signum)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert list(records.iterdir()) == []  # its record goes with it
    assert "serving on http://127.0.0.1:" in err
    assert "the default model cannot be served: unknown image model 'none-yet'" in err
    assert f"model_dirs names {unmounted}, which is no folder" in err
    assert f"model_dirs names {models}," not in err
    # a headroom larger than the machine: said at start, not only by every refusal
    assert "the image worker has no memory to work in: server.image.memory_headroom_mb" in err
    assert "GET /internal/image-steps/v1/models 200" in err
    assert "new requests are refused while the last answers finish" in err  # none in flight


def test_a_wide_bind_says_the_step_routes_stay_on_loopback(tmp_path):
    env = {**os.environ, "GMLX_BLAS": "off", "GMLX_API_KEY": "k"}
    (tmp_path / "config.toml").write_text("[server]\n")
    args = ["--config", str(tmp_path / "config.toml"), "--host", "0.0.0.0"]
    with serving(args, env) as (process, _):
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert "the step routes answer loopback peers only" in err, err[-2000:]


def test_a_stop_answers_the_requests_in_flight_first(tmp_path):
    """SIGTERM while an image is being sampled: the image is answered, a request that comes
    after is refused 503 and readiness says the server is stopping, then the process exits 0
    having let the model go."""
    import threading

    env = {**os.environ, "GMLX_BLAS": "off"}
    job = {"model": "z-image-random-tiny", "prompt": "a cat", "size": "128x128", "steps": 100}
    answers: dict = {}

    def generate(url: str) -> None:
        answers["image"] = requests.post(url + "/v1/images/generations", json=job, timeout=120)

    with serving([], env) as (process, url):
        sampling = threading.Thread(target=generate, args=(url,))
        sampling.start()
        deadline = time.monotonic() + 60
        while "image" not in answers and time.monotonic() < deadline:  # the model loaded
            metrics = requests.get(url + "/metrics", timeout=5).text
            if re.search(r"^gmlx_models_resident 1", metrics, re.M):
                break
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = requests.post(url + "/v1/images/generations", json=job, timeout=30)
        ready = requests.get(url + "/health?ready=1", timeout=30)
        sampling.join(120)
        _, err = process.communicate(timeout=60)
    assert "image" in answers and answers["image"].status_code == 200, err[-3000:]
    assert len(answers["image"].json()["data"]) == 1
    assert late.status_code == 503 and "the server is stopping" in late.text
    assert ready.status_code == 503 and ready.json()["reason"] == "the server is stopping"
    assert process.returncode == 0, err[-3000:]
    assert "stopping on SIGTERM: new requests are refused while the 1 in flight finish" in err
    assert "unloaded model z-image-random-tiny" in err and "Traceback" not in err


def test_a_second_signal_stops_at_once_with_an_image_in_flight(tmp_path):
    """SIGTERM, then SIGTERM again while an image of many steps is being sampled: the process
    ends at once, not when the image's step ends or Waitress has waited 5 s for the thread that
    waits on it (the worker abandons its jobs, so that thread ends now), exit 0, no traceback;
    the image's request is cut short."""
    import threading

    env = {**os.environ, "GMLX_BLAS": "off", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    job = {"model": "z-image-random-tiny", "prompt": "a cat", "size": "512x512", "steps": 1000}
    answers: dict = {}

    def generate(url: str) -> None:
        try:
            answers["image"] = requests.post(url + "/v1/images/generations", json=job, timeout=120)
        except requests.ConnectionError as error:
            answers["image"] = error

    with serving([], env) as (process, url):
        sampling = threading.Thread(target=generate, args=(url,))
        sampling.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the model loaded
            metrics = requests.get(url + "/metrics", timeout=5).text
            if re.search(r"^gmlx_models_resident 1", metrics, re.M):
                break
            time.sleep(0.05)
        time.sleep(1.0)  # sampling: a step at 512x512 takes about 0.4 s here
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        second = time.monotonic()
        _, err = process.communicate(timeout=60)
        ended_in = time.monotonic() - second
        sampling.join(60)
    assert process.returncode == 0, err[-3000:]
    assert "stopping at once on SIGTERM" in err and "Traceback" not in err, err[-3000:]
    assert "stopping at once: ending runs; the models go with the process" in err
    assert ended_in < 3.0, (ended_in, err[-3000:])
    image = answers["image"]
    assert isinstance(image, requests.ConnectionError) or image.status_code == 503, image


def test_serve_exits_zero_after_model_work_on_the_worker(tmp_path):
    """MLX aborts at process exit after large arrays were evaluated on the image worker thread,
    unless the process ends without C++ teardown (cli.entry)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    with serving([], env) as (process, url):
        from gmlx_contract.client import StepClient

        with StepClient(url) as client:
            latents = np.zeros((1, 64, 32, 32), np.float32)
            assert client.vae_decode(latents).shape == (1, 512, 512, 3)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-2000:]


def every_parser(parser: argparse.ArgumentParser, words=("gmlx",)):
    """(words, parser) of `gmlx` and of each of its subcommands, depth first."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from every_parser(child, (*words, name))


def test_every_command_has_a_description_and_shows_its_defaults(monkeypatch):
    """`--help` of each command says what it does, what each option does, and each option's
    default (options whose default is None, False or empty word their default in the help
    text instead)."""
    monkeypatch.setenv("COLUMNS", "200")
    parsers = dict(every_parser(cli.build_parser()))
    assert {("gmlx", "serve"), ("gmlx", "image", "sample"), ("gmlx", "image", "bench")} <= set(
        parsers
    )
    for words, parser in parsers.items():
        assert parser.description, f"{' '.join(words)} has no description"
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"{' '.join(words)} {action.option_strings[-1]} has no help text"
            if default is None or default is False or default == [] or default == argparse.SUPPRESS:
                continue
            assert f"(default: {default})" in text, (words, action.option_strings)
    serve = " ".join(parsers[("gmlx", "serve")].format_help().split())
    assert "(default: 127.0.0.1)" in serve and "(default: 8080)" in serve
    sample = " ".join(parsers[("gmlx", "image", "sample")].format_help().split())
    assert "--seed SEED noise seed (default: 0)" in sample
    assert "--width WIDTH image width in pixels (default: 1024)" in sample


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    """A folder, or a path under a file, is refused at once (2), naming the flag; the model is
    never loaded (the configuration names none that exists)."""
    config = tmp_path / "c.toml"
    config.write_text('[server]\ndefault_model = "never-loaded"\n')
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (["image", "sample", "--prompt", "x", "--out", str(tmp_path)], "is a folder; name a file"),
        (
            ["image", "sample", "--prompt", "x", "--out", str(a_file / "x.png")],
            f"{a_file} is a file, not a folder",
        ),
        (["image", "bench", "--json-out", str(tmp_path)], "--json-out"),
    ]
    for argv, words in cases:
        assert cli.main([*argv, "--config", str(config)]) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "never-loaded" not in err, err
    empty = [  # Path("") would be the current folder
        (["image", "sample", "--prompt", "x", "--out", " "], "--out: an empty path; name a file"),
        (
            ["image", "sample", "--prompt", "x", "--out", "a.png", "--preview", ""],
            "--preview: an empty path; name a file",
        ),
        (["image", "bench", "--json-out", ""], "--json-out: an empty path; name a file"),
        (["pull", "--to", "", "owner/name"], "--to: an empty path; name a folder"),
        (["model", "quantize", "m", ""], "destination: an empty path; name a folder"),
    ]
    for argv, words in empty:
        with pytest.raises(SystemExit) as stopped:
            cli.main([*argv, "--config", str(config)])
        assert stopped.value.code == 2
        assert f"argument {words}" in capsys.readouterr().err


def test_an_output_that_fails_to_write_after_the_work_is_one_line(tmp_path):
    """A full disk after sampling: the reason in one line, for the command to print (exit 1)."""
    from gmlx_server.image_cli import write_refusal

    def full_disk():
        raise OSError(28, "No space left on device")

    out = tmp_path / "a.png"
    assert write_refusal(out, full_disk) == f"cannot write {out}: No space left on device"
    assert write_refusal(out, lambda: out.write_bytes(b"png")) is None and out.is_file()


def test_a_reader_that_leaves_early_ends_a_listing_quietly(tmp_path):
    """`gmlx list | head -1`: the pipe's reader is gone before the listing is written; the
    command ends without a traceback."""
    config = tmp_path / "config.toml"
    config.write_text("[server]\n")
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "wb") as stdout:
        done = subprocess.run(
            [sys.executable, "-m", "gmlx_server", "list", "--config", str(config)],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr


def test_a_second_signal_during_the_first_ones_handling_stops_at_once_after_it(monkeypatch):
    """A second stop signal that lands while the first one's handler still runs (`timeout`
    sends SIGTERM to the server and to its process group): the first handling ends whole (its
    stop thread made and started), then the stop is one at once, with no exception raised
    inside that handling."""
    import threading

    from gmlx_server.routes.common import Traffic

    started: list = []

    class SecondSignalDuringStart(threading.Thread):
        def start(self) -> None:  # never run: the test's own process would be interrupted
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
            started.append(self)

    handlers = {signum: signal.getsignal(signum) for signum in cli.STOP_SIGNALS}
    monkeypatch.setattr(cli.threading, "Thread", SecondSignalDuringStart)
    try:
        stopping = cli._stop_on_signals(None, server=None, traffic=Traffic())
        with pytest.raises(KeyboardInterrupt):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert len(started) == 1 and stopping.cut_short.is_set()


def test_a_command_stopped_by_ctrl_c_says_so_in_one_line():
    """Ctrl-C in a command that does not catch it itself (`gmlx image sample` mid-sampling):
    one line, status 130 as a shell gives, no traceback."""
    interrupted = (
        "import gmlx_server.cli as cli\n"
        "def main():\n"
        "    raise KeyboardInterrupt\n"
        "cli.main = main\n"
        "cli.entry()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", interrupted], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "gmlx: interrupted\n"


@pytest.mark.parametrize("host", ["not-a-host.invalid", "256.1.1.1", ""])
@pytest.mark.parametrize("api_key", [None, "k"])
def test_a_host_that_names_no_address_is_refused_in_one_line(monkeypatch, capsys, host, api_key):
    monkeypatch.delenv("GMLX_API_KEY", raising=False)
    if api_key:
        monkeypatch.setenv("GMLX_API_KEY", api_key)
    assert cli.main(["serve", "--host", host, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gmlx serve: cannot listen on host {host!r}: ") and "api_key" not in err
    assert err.count("\n") == 1, err
