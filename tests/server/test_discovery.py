"""`gmlx status` and `gmlx list` (server/discovery.py): the configured server's URL and state,
and the models the configuration names, as the ComfyUI pack reads them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from gmlx_server import cli, discovery, process, server_records
from gmlx_server.config import ServerConfig, load_config

from tests.catalog import EMBEDDED_MODELS

from . import linear_family
from .conftest import config_file


@pytest.fixture(autouse=True)
def no_gmlx_environment(monkeypatch, tmp_path):
    for name in ("GMLX_HOST", "GMLX_PORT", "GMLX_API_KEY", "GMLX_MODEL_DIRS", "GMLX_DEFAULT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_server_url_is_where_a_client_on_this_machine_connects():
    assert (
        discovery.server_url(ServerConfig(host="127.0.0.1", port=9000)) == "http://127.0.0.1:9000"
    )
    assert discovery.server_url(ServerConfig(host="0.0.0.0", port=80)) == "http://127.0.0.1:80"
    assert discovery.server_url(ServerConfig(host="::", port=81)) == "http://[::1]:81"
    assert discovery.server_url(ServerConfig(host="::1", port=82)) == "http://[::1]:82"
    assert discovery.server_url(ServerConfig(host="box.lan", port=83)) == "http://box.lan:83"
    assert discovery.server_url(ServerConfig(port=0)) is None


def test_status_of_a_configured_server_that_is_not_running(tmp_path, capsys):
    port = _free_port()
    config = config_file(tmp_path, f"[server]\nport = {port}\n")
    code, out = _run(capsys, "status", "--json", "--config", str(config))
    assert code == 0
    assert json.loads(out) == {
        "url": f"http://127.0.0.1:{port}",
        "configured_url": f"http://127.0.0.1:{port}",
        "config": str(config),
        "running": False,
        "gmlx_version": None,
        "contract": None,
        "error": "connection refused",
        "resident": [],
        "record": None,
        "listening": False,
    }
    code, out = _run(capsys, "status", "--config", str(config))
    assert code == 0 and "not running (connection refused)" in out and "gmlx serve" in out


def test_status_of_a_port_another_program_holds_says_a_server_would_find_it_taken(tmp_path, capsys):
    """Something listens on the asked port but answers no handshake (another program that
    closes each connection; a stopped server's backlog takes them too): not running, and not
    to be started there."""
    import threading

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]

        def close_each() -> None:
            while True:
                try:
                    held.accept()[0].close()
                except OSError:  # the test closed the socket
                    return

        threading.Thread(target=close_each, daemon=True).start()
        config = config_file(tmp_path, f"[server]\nport = {_free_port()}\n")
        code, out = _run(capsys, "status", "--config", str(config), "--port", str(port))
        prose = out
        code, out = _run(capsys, "status", "--json", "--config", str(config), "--port", str(port))
        doc = json.loads(out)
    assert code == 0 and doc["running"] is False and doc["listening"] is True
    out = prose
    assert f"gmlx server http://127.0.0.1:{port}: something listens there but" in out
    assert "`gmlx serve` there would find the port taken" in out


def test_status_of_a_running_server(live, tmp_path, capsys):
    port = live.base.rsplit(":", 1)[1]
    config = config_file(tmp_path, f"[server]\nport = {port}\n")
    code, out = _run(capsys, "status", "--json", "--config", str(config))
    doc = json.loads(out)
    assert code == 0 and doc["running"] is True and doc["error"] is None
    assert doc["url"] == live.base and doc["contract"] == "1.0" and doc["gmlx_version"]
    assert doc["resident"] == []  # nothing loaded yet


def test_status_asks_where_its_host_and_port_say(live, tmp_path, capsys):
    port = live.base.rsplit(":", 1)[1]
    elsewhere = config_file(tmp_path, f"[server]\nport = {_free_port()}\n")
    code, out = _run(capsys, "status", "--json", "--config", str(elsewhere), "--port", port)
    doc = json.loads(out)
    assert code == 0 and doc["running"] is True and doc["url"] == live.base


def test_status_finds_a_server_started_elsewhere_by_its_record(live, tmp_path, capsys, monkeypatch):
    """The configured server does not answer, but a `gmlx serve` of this user started on
    another port does: status (and the pack through it) reports that one, naming both; asked
    for a host or port, it answers for that place alone."""
    configured = f"http://127.0.0.1:{_free_port()}"
    config = config_file(tmp_path, f"[server]\nport = {configured.rsplit(':', 1)[1]}\n")
    here = tmp_path / "served.toml"
    monkeypatch.chdir(tmp_path)  # a config named relative to the folder `gmlx serve` ran in
    with server_records.serving(live.base, Path("served.toml")) as record:
        assert record is not None and record.parent == server_records.records_folder()
        code, out = _run(capsys, "status", "--json", "--config", str(config))
        doc = json.loads(out)
        assert code == 0 and doc["running"] is True and doc["contract"] == "1.0"
        assert doc["url"] == live.base and doc["configured_url"] == configured
        assert doc["record"]["pid"] == os.getpid() and doc["record"]["config"] == str(here)
        assert json.loads(record.read_text())["config"] == str(here)  # absolute as written
        code, out = _run(capsys, "status", "--config", str(config))
        assert f"gmlx server {live.base}: running" in out
        assert f"the configured server {configured} does not answer" in out
        port = configured.rsplit(":", 1)[1]
        code, out = _run(capsys, "status", "--json", "--config", str(config), "--port", port)
        assert json.loads(out)["running"] is False and json.loads(out)["url"] == configured
    assert not record.exists()
    code, out = _run(capsys, "status", "--json", "--config", str(config))
    assert json.loads(out)["running"] is False and json.loads(out)["record"] is None


def test_a_recorded_server_that_refuses_this_client_is_passed_over(server_factory, tmp_path):
    """A recorded server that asks for another API key is not reported as found: the
    configured server is the one to start, not one that would refuse every request."""
    guarded = server_factory(config=ServerConfig(host="127.0.0.1", port=0, api_key="another"))
    config = config_file(tmp_path, f"[server]\nport = {_free_port()}\n")
    with server_records.serving(guarded.base, None):
        doc = discovery.server_status(load_config(config))
    assert doc["running"] is False and doc["record"] is None
    assert doc["url"] == doc["configured_url"]


def test_records_of_gone_processes_are_removed_and_unreadable_ones_passed_over(live):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    folder = server_records.records_folder()
    folder.mkdir(parents=True)
    stale = folder / f"{gone.stdout.strip()}.json"
    record = {"url": live.base, "pid": int(gone.stdout), "config": None, "started": 1.0}
    stale.write_text(json.dumps(record))
    (folder / "0.json").write_text(json.dumps({**record, "pid": 0}))
    (folder / "cut.json").write_text('{"url": ')
    (folder / "other.json").write_text(json.dumps({**record, "pid": "1"}))
    (folder / "true.json").write_text(json.dumps({**record, "pid": True}))
    assert server_records.running_servers() == []
    assert list(folder.iterdir()) == []  # neither stale records nor files that are none


def test_without_a_home_folder_a_server_serves_unrecorded(live, monkeypatch):
    """A service user with neither HOME nor XDG_CACHE_HOME nor a password entry: no record is
    written or read, and serving goes on."""

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(server_records.Path, "home", staticmethod(no_home))
    with server_records.serving(live.base, None) as record:
        assert record is None and server_records.running_servers() == []


def test_a_record_another_user_owns_is_not_followed(live, monkeypatch):
    """A record this user does not own (a shared cache folder) could send this user's API
    key to any URL: it is passed over, and left to its owner."""
    with server_records.serving(live.base, None) as record:
        assert [r["url"] for r in server_records.running_servers()] == [live.base]
        monkeypatch.setattr(server_records.os, "getuid", lambda: record.stat().st_uid + 1)
        assert server_records.running_servers() == [] and record.exists()
    doc = discovery.server_status(ServerConfig(port=_free_port()))
    assert doc["running"] is False and doc["record"] is None


def test_status_answers_in_time_while_a_long_job_holds_the_worker(fresh, tmp_path, monkeypatch):
    """A resident model's status waits for the image worker: while a long step holds it,
    `gmlx status` still answers within its wait (RESIDENCY_WAIT_S in all), the residency
    unknown, so the ComfyUI pack that asks it still finds the server."""
    import threading
    import time

    monkeypatch.setattr(discovery, "RESIDENCY_WAIT_S", 0.5)
    assert fresh.post_json("models/load", {"model": "alpha"}).status_code == 200
    release = threading.Event()
    fresh.ctx.service.worker.submit(release.wait, 30)
    config = config_file(tmp_path, f"[server]\nport = {fresh.base.rsplit(':', 1)[1]}\n")
    began = time.monotonic()
    try:
        doc = discovery.server_status(load_config(config))
    finally:
        release.set()
    assert time.monotonic() - began < 2.5
    assert doc["running"] is True
    assert doc["resident"] == [{"model": "alpha", "residency": None}]


def test_status_names_what_each_resident_model_holds(tmp_path, capsys):
    from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
    from gmlx_server.engine.registry import ModelRegistry

    from .conftest import serve

    folder = ensure_embedded_model(tmp_path / "cache")
    server = serve(
        ServerConfig(host="127.0.0.1", port=0),
        ModelRegistry([], folder.name, extra_models=[folder]),
    )
    try:
        server.post_json("models/load", {"model": folder.name})
        loaded = server.ctx.registry.loaded(folder.name).model
        server.ctx.service.worker.call(loaded.release_encoder)
        port = server.base.rsplit(":", 1)[1]
        config = config_file(tmp_path, f"[server]\nport = {port}\n")
        code, out = _run(capsys, "status", "--json", "--config", str(config))
        (resident,) = json.loads(out)["resident"]
        assert resident["model"] == folder.name
        encoder = resident["residency"]["encoder"]
        assert encoder["resident"] is False and encoder["policy"] == "auto"
        assert encoder["bytes"] == loaded.encoder_bytes and encoder["dtype"] == "f32"
        assert resident["residency"]["dit"]["resident"] is True
        code, out = _run(capsys, "status", "--config", str(config))
        line = f"{loaded.encoder_bytes / 1e6:.1f} MB released (auto)"
        assert code == 0 and f"  {folder.name}: dit f32" in out and f"encoder f32 {line}" in out
    finally:
        server.close()


def test_a_broken_configuration_exits_2_and_says_why(tmp_path, capsys):
    code = cli.main(["list", "--json", "--config", str(tmp_path / "absent.toml")])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    code = cli.main(["list", "--json", "--config", str(tmp_path)])
    assert code == 2 and f"config file {tmp_path} is a folder" in capsys.readouterr().err


def test_list_names_the_model_folders_and_configured_ids_default_first(tmp_path, capsys):
    root = tmp_path / "models"
    linear_family.make_model_folder(root, "alpha")
    linear_family.make_model_folder(root, "beta")
    (root / "not-a-model").mkdir()
    config = config_file(
        tmp_path,
        f'[server]\nmodel_dirs = ["{root}", "unmounted"]\ndefault_model = "beta"\n\n'
        '[models."gamma"]\n',
    )
    code, out = _run(capsys, "list", "--image", "--json", "--config", str(config))
    doc = json.loads(out)
    assert code == 0 and doc["default_model"] == "beta"
    assert [(m["model"], m["default"]) for m in doc["models"]] == [
        ("beta", True),
        ("alpha", False),
        ("gamma", False),
    ]
    assert doc["models"][0]["folder"] == str(root / "beta") and doc["models"][2]["folder"] is None
    code, out = _run(capsys, "list", "--config", str(config))
    # the test family's folders: no family of the server reads them
    assert out.splitlines()[0] == (
        f"beta (default): {root / 'beta'} (not servable: no family this server has reads it)"
    )
    assert (
        "gamma: no model folder of that id (a mistyped id? `gmlx pull` or a [models] entry" in out
    )
    unmounted = tmp_path / "unmounted"
    assert f"{root}, {unmounted} (no such folder: no models come from it)" in out


def test_list_says_why_no_family_reads_a_folder(tmp_path, capsys):
    """A Z-Image folder whose text encoder's config.json is broken is listed with the file
    and the family that could not read it: the model is not silently unsupported."""
    folder = tmp_path / "models" / "half-edited"
    (folder / "text_encoder").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    (folder / "text_encoder" / "config.json").write_text("{x")
    config = config_file(tmp_path, f'[server]\nmodel_dirs = ["{folder.parent}"]\n')
    code, out = _run(capsys, "list", "--json", "--config", str(config))
    (listed,) = [m for m in json.loads(out)["models"] if m["model"] == "half-edited"]
    config_json = folder / "text_encoder" / "config.json"
    assert listed["unservable"].startswith(
        f"no family this server has reads it: read as z_image: {config_json} is not JSON ("
    )


def test_with_no_default_model_the_embedded_models_are_listed_the_default_first(tmp_path):
    doc = discovery.configured_models(load_config(config_file(tmp_path, "[server]\n")))
    assert doc["default_model"] == "qwen-image21-random-tiny"
    assert [m["model"] for m in doc["models"]] == EMBEDDED_MODELS
    assert [m["default"] for m in doc["models"]] == [True, False, False, False, False, False]
    assert [m["folder"] for m in doc["models"]] == [None] * 6  # not generated yet in this cache
    assert all(m["embedded"] for m in doc["models"])


def test_a_default_model_naming_an_embedded_model_serves_that_one(tmp_path):
    """default_model set to an embedded model's id (as `gmlx list` names it): that model is
    listed and served, made on first use, the other embedded models not; a folder of that name
    in model_dirs is the model instead."""
    text = '[server]\ndefault_model = "z-image-random-tiny"\n'
    config = load_config(config_file(tmp_path, text))
    doc = discovery.configured_models(config)
    assert [(m["model"], m["default"], m["embedded"]) for m in doc["models"]] == [
        ("z-image-random-tiny", True, True)
    ]
    registry, _ = process.config_registry(config)
    entry = registry.resolve("")
    assert (entry.model_id, entry.family) == ("z-image-random-tiny", "z_image")
    assert set(registry.folders()) == {"z-image-random-tiny"}

    own = tmp_path / "models" / "z-image-random-tiny"  # a folder of that name, no model yet
    own.mkdir(parents=True)
    text += f'model_dirs = ["{own.parent}"]\n'
    config = load_config(config_file(tmp_path, text))
    assert process.config_registry(config)[0].resolve("").family == "z_image"
    (own / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    registry, extra = process.config_registry(config)
    assert extra == [] and registry.folders() == {"z-image-random-tiny": own}
    (listed,) = discovery.configured_models(config)["models"]
    assert (listed["folder"], listed["embedded"]) == (str(own), False)


def test_an_embedded_model_not_made_yet_is_said_to_be_made_on_first_use(tmp_path, capsys):
    config = config_file(tmp_path, "[server]\n")
    code, out = _run(capsys, "list", "--config", str(config))
    assert code == 0
    assert out.splitlines()[0] == "qwen-image21-random-tiny (default): made on first use"


def test_the_listing_names_what_the_server_lists(live, tmp_path):
    """`gmlx list` and `GET models` agree for the same model_dirs (the listing is the
    registry's own folder scan)."""
    served = {m["model"] for m in live.call("GET", "models").json()["models"]}
    root = live.ctx.registry.model_dirs[0]
    config = config_file(tmp_path, f'[server]\nmodel_dirs = ["{root}"]\ndefault_model = "alpha"\n')
    listed = {m["model"] for m in discovery.configured_models(load_config(config))["models"]}
    assert listed == served


# What the core install (`pip install gmlx-steps`, numpy and requests) lacks: the server's extras.
SERVER_EXTRAS = ("PIL", "mlx", "falcon", "waitress", "safetensors", "tokenizers", "tqdm", "gguf")


def gmlx_without(tmp_path, modules, *argv: str) -> subprocess.CompletedProcess:
    """`gmlx ARGV` in a fresh Python where `modules` cannot be imported, with a home and cache
    of its own and no GMLX_ variables."""
    without = "; ".join(f"sys.modules[{name!r}] = None" for name in modules)
    code = f"import sys; {without}; from gmlx_server import cli; sys.exit(cli.main(sys.argv[1:]))"
    env = {key: value for key, value in os.environ.items() if not key.startswith("GMLX_")} | {
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    command = [sys.executable, "-c", code, *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("command", [["--help"], ["status"], ["list"], ["list", "--json"]])
def test_help_status_and_list_run_with_the_core_install_alone(tmp_path, command):
    """As in ComfyUI's Python, where `gmlx comfyui install` puts a gmlx without the server."""
    result = gmlx_without(tmp_path, SERVER_EXTRAS, *command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout and "Traceback" not in result.stderr


def test_list_names_the_embedded_models_in_a_python_without_mlx(tmp_path):
    """ComfyUI's Python (Pillow, safetensors and tokenizers, no MLX or web server), where the
    pack asks `gmlx list` for the models of the configured server."""
    result = gmlx_without(tmp_path, ("mlx", "falcon", "waitress"), "list", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    listed = [model["model"] for model in json.loads(result.stdout)["models"]]
    assert listed == EMBEDDED_MODELS
