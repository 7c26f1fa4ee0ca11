"""The pack's connection (comfy_nodes/connection.py): adapters go up once per connection; the
handshake's candidates and texts; `start_server` starting a real `gmlx serve`; the loaders'
model list."""

import json
import logging
import socket
import sys
import time

import numpy as np
import pytest
from gmlx_comfy import connection
from gmlx_comfy.connection import Connection
from gmlx_comfy.errors import GmlxError
from gmlx_comfy.settings import DEFAULT_BASE_URL, Discovered, Settings, read_settings
from gmlx_contract.client import StepClient
from gmlx_contract.errors import NotGmlxServer
from gmlx_contract.hashing import tensor_hash
from gmlx_server import server_records

from tests.catalog import EMBEDDED_MODELS

from ..contract.stepserver import FakeStepServer, json_answer


class RecordingClient:
    """Stands for StepClient's ensure_adapter (HEAD, PUT if absent): records what went up; its
    capabilities are those of the server now."""

    def __init__(self) -> None:
        self.ensured: list[str] = []
        self.now: dict = {}

    def capabilities(self) -> dict:
        return self.now

    def ensure_adapter(self, array: np.ndarray, dtype: str | None = None) -> str:
        digest = tensor_hash(array, dtype)
        self.ensured.append(digest)
        return digest


def _connection() -> Connection:
    return Connection(url="http://x", api_key=None, client=RecordingClient(), capabilities={})


def _matrices(seed: int, count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((4, 8), dtype=np.float32) for _ in range(count)]
    return {tensor_hash(a): a for a in arrays}


def test_each_adapter_is_ensured_once_per_connection():
    conn = _connection()
    first, second = _matrices(0, 2), _matrices(1, 1)
    conn.ensure_adapters(first)
    conn.ensure_adapters({**first, **second})  # a new table naming old and new matrices
    assert conn.client.ensured == [*first, *second]
    assert conn.adapters_held == {*first, *second}


def test_an_adapter_named_by_the_wrong_hash_is_refused_and_not_held():
    conn = _connection()
    ((digest, array),) = _matrices(2, 1).items()
    wrong = "0" * 64
    with pytest.raises(GmlxError, match=wrong):
        conn.ensure_adapters({wrong: array})
    assert conn.adapters_held == set()
    conn.ensure_adapters({digest: array})
    assert conn.adapters_held == {digest}


def _limit(n: int) -> dict:
    return {"limits": {"max_adapter_bytes": n}}


def test_adapters_larger_than_the_servers_adapter_cache_are_refused_before_any_upload():
    matrices = _matrices(3, 3)  # 3 x 128 bytes
    conn = _connection()
    conn.capabilities = conn.client.now = _limit(383)
    with pytest.raises(GmlxError, match="raise server.image.adapter_cache_mb"):
        conn.ensure_adapters(matrices)
    assert conn.client.ensured == [] and conn.adapters_held == set()
    conn.client.now = _limit(384)  # the bound grew since the handshake: asked again, it fits
    conn.ensure_adapters(matrices)
    assert conn.adapters_held == set(matrices)


def test_a_limit_of_1_gib_says_nothing_of_the_adapter_cache():
    """`max_adapter_bytes` is min(1 GiB, the cache's bound): at 1 GiB the bound is unknown."""
    assert connection.adapter_cache_bytes(_limit(2**30)) is None
    assert connection.adapter_cache_bytes(_limit(2**30 - 1)) == 2**30 - 1
    assert connection.adapter_cache_bytes({}) is None


# ---------------------------------------------------------------- connecting and starting


def _free_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No gmlx settings or server configuration of this machine's user takes part."""
    for name in ("GMLX_BASE_URL", "GMLX_API_KEY", "GMLX_DEFAULT_IMAGE_MODEL", "GMLX_COMMAND"):
        monkeypatch.delenv(name, raising=False)
    for name in ("GMLX_HOST", "GMLX_PORT", "GMLX_MODEL_DIRS", "GMLX_DEFAULT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("GMLX_COMFY_SETTINGS", str(tmp_path / "comfyui.json"))
    connection._discovery.clear()
    yield tmp_path
    connection.stop_started_servers()
    connection._discovery.clear()


GMLX = [sys.executable, "-m", "gmlx_server"]


def _settings(tmp_path, *, command=GMLX, base_url="", timeout_s=600.0) -> Settings:
    return Settings(
        base_url=base_url,
        api_key=None,
        default_model="",
        path=tmp_path / "comfyui.json",
        command=tuple(command),
        timeout_s=timeout_s,
    )


def test_nothing_answering_is_one_sentence_naming_each_address(isolated):
    url = _free_url()
    with pytest.raises(GmlxError) as caught:
        connection.connect(url, start_server=False, settings=_settings(isolated))
    assert str(caught.value) == (
        f"gmlx: no gmlx server answers at {url} (connection refused); start one with "
        "`gmlx serve`, or switch on start_server"
    )


def test_default_url_tries_the_configured_server_then_the_default(isolated, monkeypatch):
    seen, discoveries = [], []

    def refused(url, key, failures):
        seen.append(url)
        failures.append(NotGmlxServer(url, "connection refused"))

    monkeypatch.setattr(connection, "_try", refused)
    configured = _free_url()
    found = Discovered(configured, configured)
    monkeypatch.setattr(Settings, "discover", lambda self: discoveries.append(1) or found)
    for _ in range(2):  # two loaders of one prompt: `gmlx status` runs once
        with pytest.raises(GmlxError) as caught:
            connection.connect("", start_server=False, settings=_settings(isolated))
    assert seen == [configured, DEFAULT_BASE_URL] * 2 and len(discoveries) == 1
    assert f"at {configured} (connection refused) or at {DEFAULT_BASE_URL}" in str(caught.value)


def test_start_server_serves_at_a_custom_url_logs_to_a_file_and_stops(
    isolated, monkeypatch, caplog
):
    """A real `gmlx serve`, started for a server_url on a port of its own."""
    monkeypatch.setenv("GMLX_DEFAULT_MODEL", "none-configured")  # no embedded model to make
    url = _free_url()
    settings = _settings(isolated)
    with caplog.at_level(logging.DEBUG):
        conn = connection.connect(url, start_server=True, settings=settings)
    assert conn.url == url and conn.capabilities["contract"]["major"] == 1
    (server,) = connection._started.values()
    assert server.command == [*GMLX, "serve", "--host", "127.0.0.1", "--port", url.rsplit(":")[-1]]
    waiting = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waiting) == 1 and str(settings.server_log) in waiting[0]
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]
    assert "serving on " + url in settings.server_log.read_text()
    # A second loader finds it answering and starts nothing.
    assert connection.connect(url, start_server=True, settings=settings) is conn
    connection.stop_started_servers()
    assert server.process.poll() is not None and not StepClient(url).health()


def test_a_server_gone_since_the_loaders_ran_is_started_again(isolated, monkeypatch):
    """ComfyUI keeps the loaders' outputs, so the next prompt after the server stopped reaches
    the pack's CLIP, VAE or model first: each makes sure the server answers, starting it again
    as the loader's start_server says, or saying what to do."""
    monkeypatch.setenv("GMLX_DEFAULT_MODEL", "none-configured")  # no embedded model to make
    url = _free_url()
    settings = _settings(isolated)
    conn = connection.connect(url, start_server=True, settings=settings)
    conn.adapters_held.add("a" * 64)
    connection.stop_started_servers()
    assert not StepClient(url).health()
    conn.ensure_reachable()
    assert StepClient(url).health() and conn.generation == 1 and not conn.adapters_held
    conn.ensure_reachable()  # answering: nothing to do
    assert conn.generation == 1
    assert connection.connect(url, start_server=False, settings=settings) is conn
    connection.stop_started_servers()
    with pytest.raises(GmlxError) as caught:
        conn.ensure_reachable()
    assert str(caught.value) == (
        f"gmlx: the server at {url} no longer answers; start it again (`gmlx serve`), or"
        " switch on the loader's start_server"
    )


def test_a_started_server_that_exits_is_reported_at_once_with_its_log(isolated):
    script = isolated / "fails.py"
    script.write_text("import sys\nprint('listen failed: port taken')\nsys.exit(3)\n")
    settings = _settings(isolated, command=[sys.executable, str(script)])
    url = _free_url()
    started = time.monotonic()
    with pytest.raises(GmlxError) as caught:
        connection.connect(url, start_server=True, settings=settings)
    assert time.monotonic() - started < 30
    text = str(caught.value)
    assert text.startswith(f"gmlx: `{sys.executable} {script} serve --host 127.0.0.1 --port ")
    assert f"exited with status 3 before answering at {url}" in text
    assert text.endswith(f"the end of its log {settings.server_log}: listen failed: port taken")
    assert text.count("gmlx:") == 1


def test_a_started_gmlx_without_the_servers_packages_is_told_the_fix(isolated):
    script = isolated / "no_falcon.py"
    script.write_text(
        "import sys\nprint(\"ModuleNotFoundError: No module named 'falcon'\")\nsys.exit(1)\n"
    )
    settings = _settings(isolated, command=[sys.executable, str(script)])
    with pytest.raises(GmlxError) as caught:
        connection.connect(_free_url(), start_server=True, settings=settings)
    text = str(caught.value)
    assert "No module named 'falcon'" in text
    assert "run `gmlx comfyui install` again from the environment that has them" in text


def test_a_started_server_that_never_answers_is_given_up_on_and_reused(isolated, monkeypatch):
    script = isolated / "silent.py"
    script.write_text("import time\nprint('loading', flush=True)\ntime.sleep(60)\n")
    monkeypatch.setattr(connection, "START_WAIT_S", 1.0)
    settings = _settings(isolated, command=[sys.executable, str(script)])
    url = _free_url()
    for _ in range(2):  # the second loader waits on the same process
        with pytest.raises(GmlxError) as caught:
            connection.connect(url, start_server=True, settings=settings)
        assert f"did not answer at {url} within 1 s and still runs" in str(caught.value)
        assert str(caught.value).endswith(": loading")
    assert settings.server_log.read_text().count("---- ") == 1
    (server,) = connection._started.values()
    connection.stop_started_servers()
    assert server.process.poll() is not None


def test_no_gmlx_command_says_where_it_looked(isolated, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(isolated / "nowhere" / "python"))
    monkeypatch.setenv("PATH", str(isolated / "empty"))
    settings = _settings(isolated, command=())
    assert settings.gmlx_command() is None
    with pytest.raises(GmlxError) as caught:
        connection.connect(_free_url(), start_server=True, settings=settings)
    text = str(caught.value)
    assert "no `gmlx` command was found to start one" in text
    assert str(isolated / "nowhere") in text and "gmlx_command" in text


def test_a_configured_command_that_cannot_run_is_named(isolated):
    missing = isolated / "no-such-gmlx"
    with pytest.raises(GmlxError) as caught:
        connection.connect(
            _free_url(), start_server=True, settings=_settings(isolated, command=[str(missing)])
        )
    text = str(caught.value)
    assert f"`{missing} serve --host 127.0.0.1 --port " in text
    assert "cannot run to start one (No such file or directory)" in text and "gmlx_command" in text


def test_start_server_refuses_an_address_it_cannot_serve(isolated):
    with pytest.raises(GmlxError, match="only at a plain http://host:port address"):
        connection.connect(
            "https://127.0.0.1:1/base", start_server=True, settings=_settings(isolated)
        )


# ---------------------------------------------------------------- the loaders' model list


def _serving(models: list[str], default: str) -> FakeStepServer:
    server = FakeStepServer().start()
    answer = {"models": [{"model": m} for m in models], "default_model": default}
    server.overrides[("GET", "models")] = json_answer(200, answer)
    return server


def test_model_list_is_the_configuration_then_the_server_then_what_it_listed_last(isolated):
    settings = _settings(isolated, base_url=_free_url())
    # Server down, nothing remembered: what the configuration names (the embedded models, the
    # default first).
    assert connection.ModelList().names(settings) == EMBEDDED_MODELS
    server = _serving(["a", "b"], default="b")
    try:
        up = _settings(isolated, base_url=server.url)
        assert connection.ModelList().names(up) == ["b", "a"]  # the server's default first
    finally:
        server.stop()
    assert connection.ModelList().names(up) == ["b", "a"]  # remembered in the settings file
    assert json.loads(up.path.read_text())["models_seen"] == {
        "url": server.url,
        "models": ["b", "a"],
    }


def test_model_list_asks_the_server_where_its_configuration_puts_it(isolated, tmp_path):
    """A server on a port of its config.toml, not the default one: the loaders' list is its
    list, and follows it when it changes (after the list's time to live)."""
    server = _serving(["a"], default="a")
    try:
        port = server.url.rsplit(":", 1)[1]
        config = tmp_path / "home" / ".config" / "gmlx-steps" / "config.toml"
        config.parent.mkdir(parents=True)
        config.write_text(f"[server]\nport = {port}\n")
        models = connection.ModelList()
        assert models.names(_settings(isolated)) == ["a"]
        server.overrides[("GET", "models")] = json_answer(
            200, {"models": [{"model": "a"}, {"model": "new"}], "default_model": "a"}
        )
        models._at -= connection.MODEL_LIST_TTL_S
        assert models.names(_settings(isolated)) == ["a", "new"]
    finally:
        server.stop()


def test_a_server_started_by_hand_elsewhere_is_used_not_doubled(isolated, tmp_path):
    """The configured port is silent, but a `gmlx serve` of this user runs on another port
    (its record says where): the loader connects to it and starts no server."""
    server = _serving(["a"], default="a")
    config = tmp_path / "home" / ".config" / "gmlx-steps" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f"[server]\nport = {_free_url().rsplit(':', 1)[1]}\n")
    try:
        with server_records.serving(server.url, None):
            conn = connection.connect("", start_server=True, settings=_settings(isolated))
    finally:
        server.stop()
    assert conn.url == server.url and connection._started == {}


def test_a_server_started_since_the_shared_discovery_is_found_before_starting_one(
    isolated, monkeypatch
):
    """The loaders' discovery (kept 30 s) found nothing; a server started by hand since: the
    loader asks `gmlx status` once more before starting one, and uses it."""
    server = _serving(["a"], default="a")
    configured = _free_url()
    answers = iter([Discovered(configured, configured), Discovered(server.url, configured)])
    monkeypatch.setattr(Settings, "discover", lambda self: next(answers))
    monkeypatch.setattr(connection, "FRESH_S", 0.0)  # the two loaders' calls are a while apart
    try:
        settings = _settings(isolated)
        with pytest.raises(GmlxError):  # the kept discovery: nothing answers
            connection.connect("", start_server=False, settings=settings)
        conn = connection.connect("", start_server=True, settings=settings)
    finally:
        server.stop()
    assert conn.url == server.url and connection._started == {}


def test_a_failed_second_discovery_keeps_what_was_found(isolated, monkeypatch):
    """The `gmlx status` asked before a start fails (it took too long): what the loaders'
    discovery found stands, and the configured server starts as configured."""
    script = isolated / "argv.py"
    script.write_text("import sys\nprint('argv', sys.argv[1:])\nsys.exit(1)\n")
    configured = _free_url()
    answers = iter([Discovered(configured, configured), None])
    monkeypatch.setattr(Settings, "discover", lambda self: next(answers))
    monkeypatch.setattr(connection, "FRESH_S", 0.0)
    settings = _settings(isolated, command=[sys.executable, str(script)])
    with pytest.raises(GmlxError):
        connection.connect("", start_server=False, settings=settings)
    with pytest.raises(GmlxError) as caught:
        connection.connect("", start_server=True, settings=settings)
    text = str(caught.value)
    assert f"before answering at {configured};" in text and text.endswith("argv ['serve']")


def test_a_connection_whose_server_stopped_moves_to_the_one_that_answers(isolated, monkeypatch):
    """The loaders' CLIP, VAE and MODEL hold one connection: where its server (one found
    elsewhere) has stopped and the configured one answers, the connection speaks to that one
    from then on, not to the address that is gone."""
    elsewhere, configured = _serving(["a"], default="a"), _serving(["a"], default="a")
    found = Discovered(elsewhere.url, configured.url)
    monkeypatch.setattr(Settings, "discover", lambda self: found)
    try:
        conn = connection.connect("", start_server=True, settings=_settings(isolated))
        assert conn.url == elsewhere.url
        elsewhere.stop()
        conn.client.close()  # its kept-alive socket, which a stopped process would have closed
        conn.ensure_reachable()
        assert conn.url == configured.url and conn.generation == 1
        assert conn.client.health() and conn.client.models()["default_model"] == "a"
        conn.ensure_reachable()  # answering: nothing more to do
        assert conn.generation == 1
    finally:
        configured.stop()


def test_require_model_names_what_the_server_lists_and_how_to_add_one(isolated):
    server = _serving(["a"], default="a")
    try:
        conn = connection.connect(server.url, start_server=False, settings=_settings(isolated))
        conn.require_model("a", remember=False)  # a loader's server_url names it
        assert "models_seen" not in read_settings(_settings(isolated).path)
        conn.require_model("a")
        assert read_settings(_settings(isolated).path)["models_seen"]["models"] == ["a"]
        with pytest.raises(GmlxError) as caught:
            conn.require_model("z")
    finally:
        server.stop()
    text = str(caught.value)
    assert text.startswith(f"gmlx: the server at {server.url} has no image model 'z' (it lists a)")
    assert "model_dirs" in text and "`gmlx pull --list`" in text


def test_the_configured_server_is_started_as_configured(isolated, monkeypatch):
    """With no explicit URL, `gmlx serve` gets no --host/--port: it serves where its
    configuration says, which is the URL `gmlx status` reported and the wait polls."""
    script = isolated / "argv.py"
    script.write_text("import sys\nprint('argv', sys.argv[1:])\nsys.exit(1)\n")
    configured = _free_url()
    monkeypatch.setattr(Settings, "discover", lambda self: Discovered(configured, configured))
    settings = _settings(isolated, command=[sys.executable, str(script)])
    with pytest.raises(GmlxError) as caught:
        connection.connect("", start_server=True, settings=settings)
    text = str(caught.value)
    assert f"`{sys.executable} {script} serve` exited with status 1" in text
    assert f"before answering at {configured};" in text and text.endswith("argv ['serve']")


def test_a_server_found_elsewhere_that_stopped_answering_starts_the_configured_one(
    isolated, monkeypatch
):
    """`gmlx status` found a server started elsewhere, which has stopped since: the loader
    starts the configured server as configured, and waits where it will answer."""
    script = isolated / "argv.py"
    script.write_text("import sys\nprint('argv', sys.argv[1:])\nsys.exit(1)\n")
    configured, gone = _free_url(), _free_url()
    monkeypatch.setattr(Settings, "discover", lambda self: Discovered(gone, configured))
    settings = _settings(isolated, command=[sys.executable, str(script)])
    with pytest.raises(GmlxError) as caught:
        connection.connect("", start_server=True, settings=settings)
    text = str(caught.value)
    assert f"before answering at {configured};" in text and text.endswith("argv ['serve']")


def test_start_server_starts_nothing_for_an_address_of_another_machine():
    """A URL whose host is not this machine's (192.0.2.1: a documentation address no machine
    holds) gets no local `gmlx serve` that could only fail to bind: the error says to start
    the server on that machine. Loopback names and the wildcard are this machine's."""
    with pytest.raises(GmlxError, match="192.0.2.1 is not an address of this machine"):
        connection.serve_flags("http://192.0.2.1:9/", "no gmlx server answers at …")
    assert connection.serve_flags("http://localhost:9/", "")[:2] == ["--host", "localhost"]
    assert all(map(connection.listenable_here, ("127.0.0.1", "0.0.0.0")))
    assert not connection.listenable_here("no-such-host.invalid")


def test_a_timeout_set_since_the_connection_was_made_applies_at_the_next_connect(isolated):
    """ComfyUI keeps its connections; a loader run after the user raised request_timeout_s
    (as a timed-out request's error tells) waits the new time, on its step link too."""
    server = FakeStepServer().start()
    try:
        conn = connection.connect(server.url, False, _settings(isolated))
        assert conn.client.timeout == 600.0
        again = connection.connect(server.url, False, _settings(isolated, timeout_s=1800.0))
        assert again is conn and conn.client.timeout == 1800.0
        assert "to wait longer than 1800 s, set request_timeout_s" in conn.client.timeout_hint
    finally:
        server.stop()
