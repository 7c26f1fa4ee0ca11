"""Settings and discovery (docs/contract.md §7.1)."""

import json

from gmlx_comfy import settings as s


def _env(tmp_path, **extra):
    return {"GMLX_COMFY_SETTINGS": str(tmp_path / "comfyui.json"), **extra}


def test_defaults_without_anything(tmp_path):
    got = s.load_settings(_env(tmp_path))
    assert got.base_url == "" and got.api_key is None and got.default_model == "z-image-turbo"
    assert got.candidate_urls("", discover=lambda: "") == ["http://127.0.0.1:8080"]


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
    assert got.candidate_urls("host:9/", discover=lambda: "http://x:1") == ["http://host:9"]
    assert got.candidate_urls("", discover=lambda: "http://x:1") == ["http://env:2"]


def test_default_url_tries_discovered_first(tmp_path):
    got = s.load_settings(_env(tmp_path))
    urls = got.candidate_urls("http://127.0.0.1:8080/", discover=lambda: "http://127.0.0.1:9000")
    assert urls == ["http://127.0.0.1:9000", "http://127.0.0.1:8080"]


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


def test_model_names_default_first():
    answer = {
        "models": [{"model": "a", "family": "qwen_image21"}, {"model": "b", "family": None}],
        "default_model": "b",
    }
    assert s.model_names_from_answer(answer) == ["b", "a"]
    assert s.model_names_from_answer([{"id": "c"}, "d", "c"]) == ["c", "d"]
    assert s.model_names_from_answer({"models": "junk"}) == []
