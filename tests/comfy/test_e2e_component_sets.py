"""End to end, a model from ComfyUI's own files: a fresh ComfyUI whose `models/` holds the tiny
Z-Image as ComfyUI's single files (tests/families/z_image/tiny/comfy.py), then `gmlx comfyui
install`, then `gmlx serve` with no model configured: the server lists the set from the
recorded install, the pack's loader offers it, and the Z-Image example workflow on it gives the
latents of the engine on the tiny diffusers folder of the same weights.

Runs only when COMFYUI_DIR names a ComfyUI checkout (and COMFYUI_PYTHON its interpreter), as
tests/comfy/test_e2e_comfyui.py; the fresh ComfyUI is a folder of links to that checkout with
its own custom_nodes/ and models/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.comfy.test_e2e_comfyui import (
    LATENT_RTOL,
    MISSING_PACKAGES_STUB,
    NEEDS_COMFYUI,
    SIZE,
    _comfyui,
    _free_port,
    _gmlx_serve,
    _json,
    _latent,
    _on_model,
    _rel,
    _run,
    _save_latent,
    _started,
    _workflow,
    direct_generate,
)
from tests.families.z_image.tiny.comfy import write_comfy_models

pytestmark = NEEDS_COMFYUI

SET_ID = "z_image_turbo_tiny + qwen_3_tiny + ae_tiny"
OWN = ("custom_nodes", "models", "user", "input", "output", "temp", "venv", ".venv", ".git")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A fresh ComfyUI holding the files, the pack installed by `gmlx comfyui install`."""
    work = tmp_path_factory.mktemp("sets_e2e")
    checkout = Path(os.environ["COMFYUI_DIR"]).resolve()
    comfy = work / "ComfyUI"
    comfy.mkdir()
    for item in checkout.iterdir():
        if item.name not in OWN:
            (comfy / item.name).symlink_to(item)
    for sub in ("custom_nodes", "input", "output"):
        (comfy / sub).mkdir()
    folder, models = write_comfy_models(work / "files")
    shutil.copytree(models, comfy / "models")
    # the tiny model's own tokenizer beside its DiT (this checkout's copy is Qwen's real one)
    shutil.copytree(folder / "tokenizer", comfy / "models" / "diffusion_models" / "tokenizer")
    env = {**os.environ, "GMLX_COMFY_SETTINGS": str(work / "comfyui.json")}
    env["XDG_CACHE_HOME"] = str(work / "cache")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    installed = subprocess.run(
        [sys.executable, "-m", "gmlx_server", "comfyui", "install", "--comfy", str(comfy)]
        + ["--python", python],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return {"work": work, "comfy": comfy, "folder": folder, "env": env, "python": python}


@pytest.fixture(scope="module")
def servers(fresh):
    work, env = fresh["work"], fresh["env"]
    config = work / "config.toml"
    config.write_text("[server]\nmodel_dirs = []\n")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    stub = work / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(MISSING_PACKAGES_STUB)
    comfy_port = _free_port()
    comfy_env = {
        **env,
        "GMLX_BASE_URL": url,
        "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]),
    }
    comfy_url = f"http://127.0.0.1:{comfy_port}"
    comfyui = _comfyui(fresh["python"], comfy_port, fresh["comfy"])
    with (
        _started(_gmlx_serve(config, port), url + "/health", work / "gmlx.log", env=env),
        _started(
            comfyui,
            comfy_url + "/object_info/GmlxModelLoader",
            work / "comfyui.log",
            cwd=fresh["comfy"],
            env=comfy_env,
        ),
    ):
        yield {
            "url": url,
            "comfy": {"url": comfy_url, "base": fresh["comfy"], "log": work / "comfyui.log"},
        }


def test_the_installed_comfyuis_files_are_listed_and_the_example_runs_on_them(fresh, servers):
    from gmlx_contract.client import StepClient

    listed = StepClient(servers["url"]).models()
    assert SET_ID in [m["model"] for m in listed["models"]]
    loader = _json(servers["comfy"]["url"] + "/object_info/GmlxModelLoader")
    options = json.dumps(loader)
    assert SET_ID in options, options[:2000]
    seed = 11
    wf = _on_model(_save_latent(_workflow("gmlx_z_image_text_to_image"), "11"), SET_ID)
    wf["8"]["inputs"]["noise_seed"] = seed
    got = _latent(servers["comfy"], _run(servers["comfy"], wf))
    from gmlx_server.engine.families.z_image import family

    engine = family.Z_IMAGE.load(fresh["folder"], "folder")
    want = direct_generate(engine, wf["4"]["inputs"]["text"], seed)
    assert got.shape == want.shape == (1, 16, SIZE // 8, SIZE // 8)
    assert _rel(got, want) <= LATENT_RTOL
