"""Models from component files through the configuration, the registry and the routes: a
ComfyUI `models/` folder named by `comfyui_model_dirs` (or recorded by `gmlx comfyui install`,
with its extra_model_paths.yaml) is listed as the sets it makes, a model entry naming `dit`,
`text_encoder` and `vae` is one too, both load and step over HTTP, and a set that cannot be
served is answered 400 naming its file, with the resident model kept."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from gmlx_server.comfyui_models import comfyui_folders, extra_model_folders
from gmlx_server.config import ServerConfig, load_config
from gmlx_server.process import config_registry

from tests.families.z_image.tiny.comfy import DIT_FILE, ENCODER_FILE, VAE_FILE, write_comfy_models
from tests.server.conftest import listed_models, serve

SET_ID = "z_image_turbo_tiny + qwen_3_tiny + ae_tiny"


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    return write_comfy_models(tmp_path_factory.mktemp("sets"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("GMLX_COMFY_SETTINGS", str(tmp_path / "comfyui.json"))
    return tmp_path / "cache"


def write_config(tmp_path, models, entries: str = "") -> object:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[server]\ncomfyui_model_dirs = ["{models}"]\ndefault_model = "{SET_ID}"\n{entries}'
    )
    return load_config(path, env={})


def test_comfyuis_folder_is_listed_as_its_sets_and_serves_them(comfy, cache, tmp_path):
    _, models = comfy
    bad = tmp_path / "z_image_turbo_cut.safetensors"
    bad.write_bytes((models / "diffusion_models" / DIT_FILE).read_bytes()[:-64])
    entries = (
        f'[models."mine"]\ndit = "{models / "diffusion_models" / DIT_FILE}"\n'
        f'text_encoder = "{models / "text_encoders" / ENCODER_FILE}"\n'
        f'vae = "{models / "vae" / VAE_FILE}"\nquantize = 8\n'
        f'[models."cut"]\ndit = "{bad}"\n'
        f'text_encoder = "{models / "text_encoders" / ENCODER_FILE}"\n'
        f'vae = "{models / "vae" / VAE_FILE}"\n'
    )
    config = write_config(tmp_path, models, entries)
    registry, _ = config_registry(config)
    assert {SET_ID, "mine"} <= set(registry.folders())
    assert all(str(p).startswith(str(cache)) for p in registry.folders().values())
    server = serve(config, registry)
    try:
        listed = {m["model"] for m in server.call("GET", "models").json()["models"]}
        assert {SET_ID, "mine"} <= listed and "cut" not in listed
        status = server.call("GET", f"models/{SET_ID}/status").json()
        assert status["family"] == "z_image" and status["variant"] == "turbo"
        assert server.post_json("models/load", {"model": SET_ID}).status_code == 200
        # status and load answer a resolution failure 404, the routes that load on demand 400
        # (docs/contract.md §2): each names the file and why
        refused = server.call("GET", "models/cut/status")
        assert (
            refused.status_code == 404 and "cut short" in refused.text and bad.name in refused.text
        )
        refused = server.post_json("encode", {"model": "cut", "text": "a boat"})
        assert refused.status_code == 400 and "cut short" in refused.text
        assert registry.resident_ids() == [SET_ID]
        assert server.post_json("models/load", {"model": "mine"}).status_code == 200
        mine = server.call("GET", "models/mine/status").json()
        assert mine["quantization"]["dit"]["bits"] == 8
    finally:
        server.close()


def test_gmlx_list_names_the_sets(comfy, cache, tmp_path):
    _, models = comfy
    write_config(tmp_path, models)
    assert SET_ID in listed_models(tmp_path / "config.toml")
    done = subprocess.run(
        [sys.executable, "-m", "gmlx_server", "list", "--config", str(tmp_path / "config.toml")],
        capture_output=True,
        text=True,
        check=True,
    )
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(SET_ID)]
    assert f"dit {models / 'diffusion_models' / DIT_FILE}" in line and "vae " in line


def test_a_recorded_comfyui_install_and_its_extra_model_paths_are_read(comfy, cache, tmp_path):
    folder, models = comfy
    checkout = tmp_path / "ComfyUI"
    (checkout / "models").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    for kind in ("diffusion_models", "text_encoders", "vae"):
        shutil.copytree(models / kind, elsewhere / kind)
    (checkout / "extra_model_paths.yaml").write_text(
        "mine:\n"
        f"  base_path: {elsewhere}\n"
        "  diffusion_models: |\n    diffusion_models\n    unet\n"
        "  text_encoders: text_encoders\n"
        "  vae: vae\n"
    )
    record = {
        "installs": [
            {"comfy_dir": str(checkout), "link": str(checkout / "x"), "python": sys.executable}
        ]
    }
    (tmp_path / "comfyui.json").write_text(json.dumps(record))
    found = extra_model_folders(checkout / "extra_model_paths.yaml")
    assert found["dit"] == [elsewhere / "diffusion_models", elsewhere / "unet"]
    folders = comfyui_folders([])
    assert elsewhere / "vae" in folders["vae"] and checkout / "models" / "vae" in folders["vae"]
    sets = ServerConfig().component_sets()
    assert SET_ID in sets and sets[SET_ID].dit == elsewhere / "diffusion_models" / DIT_FILE


def test_gmlx_image_sample_takes_the_files_as_flags(comfy, tmp_path):
    """`--dit --text-encoder --vae` with no --model: the same image as the diffusers folder."""
    folder, models = comfy
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env["GMLX_COMFY_SETTINGS"] = str(tmp_path / "none.json")
    common = [
        "--prompt",
        "a red fox",
        "--width",
        "64",
        "--height",
        "48",
        "--seed",
        "5",
        "--steps",
        "2",
    ]
    line = [sys.executable, "-m", "gmlx_server", "image", "sample", *common]
    files = [
        "--dit",
        str(models / "diffusion_models" / DIT_FILE),
        "--text-encoder",
        str(models / "text_encoders" / ENCODER_FILE),
        "--vae",
        str(models / "vae" / VAE_FILE),
    ]
    config = ["--config", str(tmp_path / "empty.toml")]
    (tmp_path / "empty.toml").write_text("")
    sets = subprocess.run(
        line + files + config + ["--out", str(tmp_path / "set.png")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert sets.returncode == 0, sets.stderr[-2000:]
    direct = subprocess.run(
        line + ["--model", str(folder), "--out", str(tmp_path / "folder.png")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert (tmp_path / "set.png").read_bytes() == (tmp_path / "folder.png").read_bytes()
    cut = tmp_path / "z_image_turbo_cut.safetensors"
    cut.write_bytes((models / "diffusion_models" / DIT_FILE).read_bytes()[:-64])
    files[1] = str(cut)
    refused = subprocess.run(
        line + files + config + ["--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert refused.returncode != 0 and "cut short" in refused.stderr


def test_a_listing_reuses_the_sets_and_their_folders_until_their_files_change(comfy, tmp_path):
    """A listing runs on a step's path: the sets are asked for again after SET_LISTING_TTL_S,
    and a set's folder is made again only when one of its files changed."""
    from gmlx_server.engine import registry as registry_module
    from gmlx_server.engine.components import ComponentFiles
    from gmlx_server.engine.registry import ModelRegistry

    _, models = comfy
    dit = tmp_path / DIT_FILE
    shutil.copy(models / "diffusion_models" / DIT_FILE, dit)
    files = ComponentFiles(dit, models / "text_encoders" / ENCODER_FILE, models / "vae" / VAE_FILE)
    asked = []
    now = [0.0]
    registry = ModelRegistry(
        component_sets=lambda: asked.append(1) or {"mine": files}, sets_dir=tmp_path / "sets"
    )
    registry._clock = lambda: now[0]
    folder = registry.folders()["mine"]
    stamp = (folder / "gmlx_embedded.json").stat().st_mtime_ns
    assert registry.folders()["mine"] == folder and len(asked) == 1
    now[0] += registry_module.SET_LISTING_TTL_S
    assert registry.folders()["mine"] == folder and len(asked) == 2
    assert (folder / "gmlx_embedded.json").stat().st_mtime_ns == stamp  # not made again
    dit.write_bytes(dit.read_bytes())  # the same bytes, a new file time
    now[0] += registry_module.SET_LISTING_TTL_S
    assert registry.folders()["mine"] != folder  # its fingerprint covers the file's time


def test_a_set_that_cannot_be_served_is_said_in_the_log_once(comfy, tmp_path, caplog):
    """A DiT file of a family whose name says no variant makes a set the listing leaves out:
    the log says which and why, once while the reason stays."""
    from gmlx_server.engine import registry as registry_module
    from gmlx_server.engine.components import ComponentFiles
    from gmlx_server.engine.registry import ModelRegistry

    _, models = comfy
    dit = tmp_path / "z_image_q8.safetensors"
    shutil.copy(models / "diffusion_models" / DIT_FILE, dit)
    files = ComponentFiles(dit, models / "text_encoders" / ENCODER_FILE, models / "vae" / VAE_FILE)
    now = [0.0]
    registry = ModelRegistry(component_sets=lambda: {"q8": files}, sets_dir=tmp_path / "sets")
    registry._clock = lambda: now[0]
    with caplog.at_level("WARNING", logger="gmlx.server"):
        assert "q8" not in registry.folders()
        now[0] += registry_module.SET_LISTING_TTL_S
        assert "q8" not in registry.folders()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "model 'q8' from component files cannot be served: "
        f"{dit} does not say which Z-Image variant it is; name it in the model entry:"
        " variant = one of 'turbo', 'base'"
    ]
