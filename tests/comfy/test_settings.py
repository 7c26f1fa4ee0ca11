"""Settings and discovery (docs/contract.md §7.1)."""

import json

from gmlx_comfy import settings as s


def _env(tmp_path, **extra):
    return {"GMLX_COMFY_SETTINGS": str(tmp_path / "comfyui.json"), **extra}


def test_defaults_without_anything(tmp_path):
    got = s.load_settings(_env(tmp_path))
    # No default model of its own: the loaders put the server's default first.
    assert got.base_url == "" and got.api_key is None and got.default_model == ""
    assert s.candidate_urls(got.explicit_url("")) == ["http://127.0.0.1:8080"]


def test_priority_env_over_file(tmp_path):
    (tmp_path / "comfyui.json").write_text(
        json.dumps(
            {"base_url": "http://file:1", "api_key": "filekey", "default_model": "qwen-file"}
        )
    )
    from_file = s.load_settings(_env(tmp_path))
    assert (from_file.base_url, from_file.api_key, from_file.default_model) == (
        "http://file:1",
        "filekey",
        "qwen-file",
    )
    from_env = s.load_settings(
        _env(
            tmp_path,
            GMLX_BASE_URL="http://env:2",
            GMLX_API_KEY="k",
            GMLX_DEFAULT_IMAGE_MODEL="qwen-env",
        )
    )
    assert (from_env.base_url, from_env.api_key, from_env.default_model) == (
        "http://env:2",
        "k",
        "qwen-env",
    )


def test_widget_url_wins_and_is_the_only_candidate(tmp_path):
    got = s.load_settings(_env(tmp_path, GMLX_BASE_URL="http://env:2"))
    assert got.explicit_url("host:9/") == "http://host:9"
    found = s.Discovered("http://x:1", "http://x:1")
    assert s.candidate_urls(got.explicit_url("host:9/"), found) == ["http://host:9"]
    assert s.candidate_urls(got.explicit_url(""), found) == ["http://env:2"]


def test_default_url_tries_discovered_first(tmp_path):
    got = s.load_settings(_env(tmp_path))
    assert got.explicit_url("http://127.0.0.1:8080/") == ""  # the default is not explicit
    urls = s.candidate_urls("", s.Discovered("http://127.0.0.1:9000", "http://127.0.0.1:9000"))
    assert urls == ["http://127.0.0.1:9000", "http://127.0.0.1:8080"]
    # a server found elsewhere, then the configured one, then the default
    found = s.Discovered("http://127.0.0.1:9000", "127.0.0.1:7000/")
    assert s.candidate_urls("", found) == [
        "http://127.0.0.1:9000",
        "http://127.0.0.1:7000",
        "http://127.0.0.1:8080",
    ]


def test_settings_file_location(tmp_path, monkeypatch):
    assert s.settings_path({"GMLX_COMFY_SETTINGS": str(tmp_path / "x.json")}) == tmp_path / "x.json"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert s.settings_path({}) == tmp_path / ".config" / "gmlx" / "comfyui.json"


def test_broken_settings_file_reads_empty(tmp_path):
    (tmp_path / "comfyui.json").write_text("{not json")
    assert s.load_settings(_env(tmp_path)).base_url == ""
    (tmp_path / "comfyui.json").write_text("[1, 2]")
    assert s.read_settings(tmp_path / "comfyui.json") == {}


def test_write_settings_merges(tmp_path):
    path = tmp_path / "sub" / "comfyui.json"
    s.write_settings(path, {"base_url": "http://a:1"})
    s.write_settings(path, {"installed": {"link": "x"}})
    assert json.loads(path.read_text()) == {"base_url": "http://a:1", "installed": {"link": "x"}}


def test_discovered_url_shapes():
    assert s.discovered_url({"url": "http://a:1"}) == "http://a:1"
    assert s.discovered_url({"server": {"base_url": "http://b:2"}}) == "http://b:2"
    assert s.discovered_url(None) == "" and s.discovered_url({"running": False}) == ""


def test_discovered_names_the_configured_server_apart_from_one_found_elsewhere():
    elsewhere = {"url": "http://a:9", "configured_url": "http://a:8"}
    assert s.discovered(elsewhere) == s.Discovered("http://a:9", "http://a:8")
    assert s.discovered({"url": "http://a:1"}) == s.Discovered("http://a:1", "http://a:1")
    port_0 = {"url": "http://a:9", "configured_url": None}  # configured to pick its port
    assert s.discovered(port_0) == s.Discovered("http://a:9", "")
    assert s.discovered(None) == s.Discovered()


def test_model_names_default_first():
    answer = {
        "models": [{"model": "a", "family": "qwen_image21"}, {"model": "b", "family": None}],
        "default_model": "b",
    }
    assert s.model_names_from_answer(answer) == ["b", "a"]
    assert s.model_names_from_answer([{"id": "c"}, "d", "c"]) == ["c", "d"]
    assert s.model_names_from_answer({"models": "junk"}) == []


def test_the_gmlx_command_is_the_configured_one_else_beside_python_else_on_path(
    tmp_path, monkeypatch
):
    configured = s.load_settings(_env(tmp_path, GMLX_COMMAND="/opt/gmlx/bin/gmlx --flag 'a b'"))
    assert configured.gmlx_command() == ["/opt/gmlx/bin/gmlx", "--flag", "a b"]
    (tmp_path / "comfyui.json").write_text(json.dumps({"gmlx_command": ["/x/gmlx"]}))
    assert s.load_settings(_env(tmp_path)).gmlx_command() == ["/x/gmlx"]
    (tmp_path / "comfyui.json").unlink()
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    monkeypatch.setattr(s.sys, "executable", str(venv / "python"))
    on_path = tmp_path / "path"
    on_path.mkdir()
    (on_path / "gmlx").write_text("#!/bin/sh\n")
    (on_path / "gmlx").chmod(0o755)
    monkeypatch.setenv("PATH", str(on_path))
    found = s.load_settings(_env(tmp_path))
    assert found.gmlx_command() == [str(on_path / "gmlx")]
    (venv / "gmlx").write_text("")
    assert found.gmlx_command() == [str(venv / "gmlx")]  # ComfyUI's own environment first
    # To serve, the PATH one comes first where this Python lacks the server's packages.
    monkeypatch.setattr(s, "server_installed_here", lambda: False)
    assert found.gmlx_command(serve=True) == [str(on_path / "gmlx")]
    monkeypatch.setattr(s, "server_installed_here", lambda: True)
    assert found.gmlx_command(serve=True) == [str(venv / "gmlx")]


def test_server_packages_are_looked_up_in_this_python(monkeypatch):
    assert s.server_installed_here()  # the dev install carries the server extra
    monkeypatch.setattr(s, "SERVER_MODULES", (*s.SERVER_MODULES, "no_such_module_anywhere"))
    assert not s.server_installed_here()


def test_remembered_models_and_the_server_log_live_beside_the_settings(tmp_path):
    got = s.load_settings(_env(tmp_path))
    assert got.remembered_models() == [] and got.server_log == tmp_path / "server.log"
    got.remember_models("http://a:1", ["b", "a"])
    before = (tmp_path / "comfyui.json").stat().st_mtime_ns
    got.remember_models("http://a:1", ["b", "a"])  # unchanged: not written again
    assert (tmp_path / "comfyui.json").stat().st_mtime_ns == before
    assert got.remembered_models() == ["b", "a"]
    assert [p.name for p in tmp_path.iterdir()] == ["comfyui.json"]  # no temporary left


def test_the_request_timeout_comes_from_the_environment_then_the_file(tmp_path):
    """A mistyped value falls back on the default rather than stop ComfyUI loading the pack."""
    (tmp_path / "comfyui.json").write_text(json.dumps({"request_timeout_s": 1800}))
    assert s.load_settings(_env(tmp_path)).timeout_s == 1800.0
    assert s.load_settings(_env(tmp_path, GMLX_REQUEST_TIMEOUT_S="90")).timeout_s == 90.0
    for wrong in ("soon", "-5", "0", "inf", "nan"):
        (tmp_path / "comfyui.json").write_text(json.dumps({"request_timeout_s": wrong}))
        assert s.load_settings(_env(tmp_path)).timeout_s == s.DEFAULT_TIMEOUT_S, wrong
    hint = s.load_settings(_env(tmp_path)).timeout_hint
    assert "request_timeout_s in" in hint and "GMLX_REQUEST_TIMEOUT_S" in hint
