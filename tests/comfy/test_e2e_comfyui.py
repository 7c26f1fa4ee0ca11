"""End to end: a real ComfyUI (headless, CPU) with the pack, driving a real `gmlx serve` on a
tiny Qwen-Image 2.1 folder, through ComfyUI's HTTP API.

Runs only when COMFYUI_DIR names a ComfyUI checkout (CI has none). COMFYUI_PYTHON names the
interpreter with ComfyUI's requirements (default: this one). See docs/comfyui.md.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"), reason="COMFYUI_DIR is not set"),
]

WORKFLOWS = Path(__file__).resolve().parents[2] / "comfy_nodes" / "example_workflows"
MODEL_ID = "qwen-tiny"
SIZE = 64
START_TIMEOUT_S = 300.0
PROMPT_TIMEOUT_S = 600.0
# ComfyUI uses a torch-side euler (x + d * dt with d = (x - denoised) / sigma) where the
# server uses x + dt * v; both float32, so images agree to rounding, then 8-bit quantisation.
PIXEL_TOLERANCE = 2

# ComfyUI imports torchvision only for model families the pack never builds; where the local
# torch wheel has no matching torchvision this stands in a module transformers reads as absent.
TORCHVISION_STUB = """
import importlib.util, importlib.machinery, sys, types
if importlib.util.find_spec("torchvision") is None:
    tv = types.ModuleType("torchvision"); tv.transforms = types.ModuleType("torchvision.transforms")
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    sys.modules["torchvision"] = tv; sys.modules["torchvision.transforms"] = tv.transforms
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def _json(url: str, doc=None):
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as answer:
        return json.loads(answer.read())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def gmlx_server(workdir):
    from tests.qwen_dit.folder import build_folder

    models = workdir / "models"
    build_folder(models / MODEL_ID, variant="base")
    config = workdir / "config.toml"
    config.write_text(
        f'[server]\nmodel_dirs = ["{models}"]\ndefault_model = "{MODEL_ID}"\n', encoding="utf-8"
    )
    port = _free_port()
    log = open(workdir / "gmlx.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gmlx_server",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/health", proc)
        yield {"url": url, "config": config}
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def comfyui(workdir, gmlx_server):
    from gmlx_comfy.install import link_pack

    comfy_dir = Path(os.environ["COMFYUI_DIR"]).resolve()
    custom_nodes = comfy_dir / "custom_nodes"
    custom_nodes.mkdir(exist_ok=True)
    link_pack(custom_nodes)
    inputs, outputs = workdir / "input", workdir / "output"
    inputs.mkdir()
    outputs.mkdir()
    stub = workdir / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(TORCHVISION_STUB, encoding="utf-8")
    port = _free_port()
    env = {
        **os.environ,
        "GMLX_BASE_URL": gmlx_server["url"],
        "GMLX_COMFY_SETTINGS": str(workdir / "comfyui.json"),
        "GMLX_DEFAULT_IMAGE_MODEL": MODEL_ID,
        "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]),
    }
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    log = open(workdir / "comfyui.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            python,
            "main.py",
            "--cpu",
            "--listen",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-auto-launch",
            "--input-directory",
            str(inputs),
            "--output-directory",
            str(outputs),
        ],
        cwd=comfy_dir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/object_info/GmlxModelLoader", proc)
        yield {"url": url, "inputs": inputs, "outputs": outputs, "log": workdir / "comfyui.log"}
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _workflow(name: str, **size) -> dict:
    wf = json.loads((WORKFLOWS / f"{name}.api.json").read_text())
    for node in wf.values():
        inputs = node["inputs"]
        if "model_name" in inputs:
            inputs["model_name"] = MODEL_ID
        for key in ("width", "height"):
            if key in inputs:
                inputs[key] = size.get(key, SIZE)
    return wf


def _queue(comfy: dict, workflow: dict) -> str:
    answer = _json(comfy["url"] + "/prompt", {"prompt": workflow, "client_id": uuid.uuid4().hex})
    return answer["prompt_id"]


def _wait_done(comfy: dict, prompt_id: str) -> dict:
    deadline = time.monotonic() + PROMPT_TIMEOUT_S
    while time.monotonic() < deadline:
        history = _json(f"{comfy['url']}/history/{prompt_id}")
        if (
            prompt_id in history
            and history[prompt_id].get("status", {}).get("completed") is not None
        ):
            return history[prompt_id]
        time.sleep(0.5)
    raise TimeoutError(prompt_id)


def _image(comfy: dict, entry: dict) -> np.ndarray:
    from PIL import Image

    for output in entry["outputs"].values():
        for image in output.get("images", []):
            path = comfy["outputs"] / image.get("subfolder", "") / image["filename"]
            return np.asarray(Image.open(path)).astype(np.int16)
    raise AssertionError(f"no image in {entry}")


def _run(comfy: dict, workflow: dict) -> np.ndarray:
    entry = _wait_done(comfy, _queue(comfy, workflow))
    assert entry["status"]["status_str"] == "success", (entry["status"], comfy["log"].read_text())
    return _image(comfy, entry)


def test_text_to_image_equals_gmlx_image_sample(comfyui, gmlx_server, workdir):
    wf = _workflow("text_to_image")
    wf["8"]["inputs"]["noise_seed"] = 3
    steps, prompt = 4, wf["4"]["inputs"]["text"]
    wf["7"]["inputs"]["steps"] = steps
    got = _run(comfyui, wf)
    out = workdir / "direct.png"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gmlx_server",
            "image",
            "sample",
            "--config",
            str(gmlx_server["config"]),
            "--model",
            MODEL_ID,
            "--prompt",
            prompt,
            "--width",
            str(SIZE),
            "--height",
            str(SIZE),
            "--steps",
            str(steps),
            "--cfg",
            "1",
            "--seed",
            "3",
            "--out",
            str(out),
        ],
        check=True,
    )
    from PIL import Image

    want = np.asarray(Image.open(out)).astype(np.int16)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= PIXEL_TOLERANCE


def test_lora_changes_the_image(comfyui, gmlx_server):
    import torch
    from gmlx_contract.client import StepClient
    from safetensors.torch import save_file

    manifest = StepClient(gmlx_server["url"]).manifest(MODEL_ID)
    lora = _tiny_lora(manifest, torch)
    loras = Path(os.environ["COMFYUI_DIR"]) / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    save_file(lora, loras / "gmlx_e2e_lora.safetensors")
    wf = _workflow("lora")
    wf["30"]["inputs"]["lora_name"] = "gmlx_e2e_lora.safetensors"
    wf["11"]["inputs"]["steps"] = 2
    with_lora = _run(comfyui, wf)
    wf["30"]["inputs"]["strength_model"] = 0.0
    without = _run(comfyui, wf)
    assert np.abs(with_lora - without).max() > 0


def _tiny_lora(manifest: dict, torch) -> dict:
    """A rank-2 LoRA on the first attention query of the tiny DiT, in ComfyUI's naming."""
    entry = next(t for t in manifest["tensors"] if t["name"].endswith("attn.to_q.weight"))
    out_dim, in_dim = entry["shape"]
    base = "diffusion_model." + entry["name"][: -len(".weight")]
    g = torch.Generator().manual_seed(0)
    return {
        f"{base}.lora_up.weight": torch.randn(out_dim, 2, generator=g),
        f"{base}.lora_down.weight": torch.randn(2, in_dim, generator=g),
        f"{base}.alpha": torch.tensor(2.0),
    }


def test_interrupt_stops_the_prompt_and_frees_the_server(comfyui, gmlx_server):
    wf = _workflow("text_to_image", width=256, height=256)
    wf["7"]["inputs"]["steps"] = 200
    prompt_id = _queue(comfyui, wf)
    time.sleep(5.0)
    urllib.request.urlopen(urllib.request.Request(comfyui["url"] + "/interrupt", data=b""))
    entry = _wait_done(comfyui, prompt_id)
    assert entry["status"]["status_str"] != "success"
    # the server is free again: a short prompt runs to the end
    quick = _workflow("text_to_image")
    quick["7"]["inputs"]["steps"] = 2
    _run(comfyui, quick)
