"""End to end: a real ComfyUI (headless, CPU) with the pack, driving a real `gmlx serve` on its
embedded tiny models (Qwen-Image 2.1, the default, and Z-Image), through ComfyUI's HTTP API.

Runs only when COMFYUI_DIR names a ComfyUI checkout (CI has none). COMFYUI_PYTHON names the
interpreter with ComfyUI's requirements (default: this one). See docs/comfyui.md.

Results are compared as latents (a SaveLatent node beside each SaveImage) against the same
engine called in this process: `sampling.generate` (what `gmlx image sample` runs) or
`sampling.sample` with ComfyUI's own sigmas and, for LoRA, a patch table built here from the
LoRA file. ComfyUI's euler computes x + (x - denoised) / sigma * dt where the server sampler
computes x + v * dt, both in float32, so the latents agree to rounding, not bit for bit.

The prompts are the example workflows' API copies as shipped. With CHROMIUM naming a Chromium
binary (and Playwright installed) the browser check also opens each example from the
frontend's template browser and runs it from there.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.comfy.workflow_files import (
    CONTROL_AFTER_GENERATE,
    FLUX2_KLEIN_MODEL,
    FLUX2_KLEIN_NAMES,
    FLUX3_KLEIN_MODEL,
    NAMES,
    STOCK_NODES,
    UPLOAD_BUTTONS,
    api_workflow,
    ui_to_api,
    ui_workflow,
)

# The marks of every test that runs a ComfyUI: the checkout COMFYUI_DIR names.
NEEDS_COMFYUI = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"), reason="COMFYUI_DIR is not set"),
]
pytestmark = NEEDS_COMFYUI

SIZE = 64
# The server's embedded tiny Z-Image (server/engine/families/z_image/embedded.py).
Z_IMAGE_MODEL = "z-image-random-tiny"
# The tiny FLUX.2 klein (4B, distilled) folder the server's model dir holds
# (tests/families/flux2_klein/tiny).
FLUX2_MODEL = "flux2-klein-tiny"
GGUF_MODEL = "qwen-image21-gguf-q4-k-m-tiny"  # a Q4_K_M GGUF DiT (write_gguf_model)
# The server's embedded tiny Krea 2 turbo (server/engine/families/krea2/embedded.py).
KREA2_MODEL = "krea2-random-tiny"
# The server's embedded tiny MOSS-Image (server/engine/families/moss_image/embedded.py).
MOSS_MODEL = "moss-image-random-tiny"
START_TIMEOUT_S = 300.0
PROMPT_TIMEOUT_S = 600.0
# Relative L2 of ComfyUI's final latents against the in-process engine's (measured: ~2e-7).
LATENT_RTOL = 1e-5
# uni_pc_bh2: ComfyUI's float32 sigma conversions at its final sigma 0.001 (measured: 1.7e-5).
UNIPC_LATENT_RTOL = 1e-4
# ComfyUI's SaveImage truncates to 8 bits where `gmlx image sample` rounds.
PIXEL_TOLERANCE = 1
# The quantized server's `--quantize`.
QUANTIZE_BITS = 4
ELSEWHERE_MODEL = "z-image-elsewhere"  # on the quantized server alone
LORA_STRENGTH = 0.8
LORA_RANK, LORA_ALPHA = 2, 1.0
# The interrupt test's image: big enough that one step of the tiny model takes a while.
INTERRUPT_SIZE = 1024
STEP_LINE = re.compile(r"POST \S*/step (\d{3}) ([0-9.]+) ms")
EXAMPLE_PICTURE = "example.png"
# The browser check: a Chromium binary (Playwright drives it; it downloads no browser).
CHROMIUM = os.environ.get("CHROMIUM")
# Where the browser check saves a screenshot of each example after its run, when set.
SCREENSHOT_DIR = os.environ.get("COMFYUI_SCREENSHOTS")
VIEWPORT = {"width": 1600, "height": 900}

# ComfyUI imports torchvision and torchaudio for model families and nodes the pack never uses,
# newer ComfyUI at start-up (`from torchvision.ops import roi_align`, `import torchaudio` in
# comfy/sd.py). Where the local torch wheel has no matching build of them, this finder stands in
# their modules: a name taken from one is a placeholder that raises when called, and the package
# has neither version nor file, so transformers' version probe reads it as absent.
MISSING_PACKAGES_STUB = """
import importlib.abc, importlib.machinery, importlib.util, sys, types

class Missing:
    def __init__(self, name):
        self.name = name
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(self.name + "." + attr)
    def __call__(self, *args, **kwargs):
        raise ImportError(self.name + " is not installed")

class MissingModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(self.__name__ + "." + attr)

class MissingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages):
        self.packages = packages
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        return MissingModule(spec.name)
    def exec_module(self, module):
        module.__path__ = []

absent = {p for p in ("torchvision", "torchaudio") if importlib.util.find_spec(p) is None}
if absent:
    sys.meta_path.append(MissingFinder(absent))
"""


# ---------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = START_TIMEOUT_S) -> None:
    """Until `url` answers. ComfyUI answers `{}` for a node it does not have: a ready URL of
    /object_info/NODE that answers so means the pack did not import, said at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                body = answer.read()
        except OSError:
            time.sleep(0.5)
            continue
        if "/object_info/" in url and json.loads(body) == {}:
            raise RuntimeError(
                f"ComfyUI has no node {url.rsplit('/', 1)[1]}: the pack did not import (its log"
                " says why; COMFYUI_PYTHON must have gmlx-steps installed, docs/comfyui.md)"
            )
        return
    raise TimeoutError(url)


def _json(url: str, doc=None):
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as err:  # ComfyUI's answer says which node it refused
        raise AssertionError(f"{url}: {err.code} {err.read()[:3000]!r}") from err


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


@contextlib.contextmanager
def _started(command: list[str], ready: str, log_path: Path, **popen):
    """`command` running, its output in `log_path`, once `ready` (a URL of it) answers; yields
    the process, stopped after if it still runs (`popen`: Popen's other arguments)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **popen)
        try:
            _wait_http(ready, proc)
            yield proc
        finally:
            if proc.poll() is None:
                _stop(proc)


def _gmlx_serve(config: Path, port: int, *flags: str) -> list[str]:
    """`gmlx serve` of the configuration on the loopback port."""
    command = [sys.executable, "-m", "gmlx_server", "serve", "--config", str(config)]
    return [*command, "--port", str(port), *flags]


def _comfyui(python: str, port: int, base: Path) -> list[str]:
    """ComfyUI's main.py on the CPU on the loopback port, its base directory `base` (run from
    its checkout)."""
    command = [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port)]
    return [*command, "--disable-auto-launch", "--base-directory", str(base)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def gmlx_server(workdir):
    """`gmlx serve` with one model dir holding a tiny FLUX.2 klein folder and no default model:
    it serves that model and its embedded models, the default `qwen-image21-random-tiny` and
    the Z-Image model."""
    from tests.families.flux2_klein.tiny.folder import build_tiny_folder as build_flux2_folder

    models = workdir / "models"
    build_flux2_folder(models / FLUX2_MODEL, family="flux2_klein", num_single_layers=1)
    write_gguf_model(workdir / "embedded", models / GGUF_MODEL)
    config = workdir / "config.toml"
    config.write_text(f"[server]\nmodel_dirs = [{json.dumps(str(models))}]\n", encoding="utf-8")
    port = _free_port()
    url, log_path = f"http://127.0.0.1:{port}", workdir / "gmlx.log"
    with _started(_gmlx_serve(config, port), url + "/health", log_path):
        from gmlx_contract.client import StepClient

        model = StepClient(url).models()["default_model"]
        yield {"url": url, "config": config, "log": log_path, "model": model}


def write_gguf_model(scratch: Path, target: Path) -> None:
    """A Qwen-Image 2.1 folder (the embedded model's, its DiT 256 wide so K-quants' 256-blocks
    fit) whose DiT is one GGUF file in llama.cpp's Q4_K_M mix: the block linears Q4_K, the value
    and MLP-down matrices of the first block Q6_K, so its fused q/k/v mixes the two."""
    from gguf import GGMLQuantizationType as T
    from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model

    from tests.engine.gguf_files import write_dit
    from tests.families.qwen_image21.test_gguf import CONFIG, draw_weights, model_folder

    model_folder(ensure_embedded_model(scratch), target, CONFIG)
    weights = draw_weights(CONFIG, 21)
    more_bits = ("transformer_blocks.0.attn.to_v.weight", "transformer_blocks.0.img_mlp.out.weight")
    types = {
        name: T.Q6_K if name in more_bits else T.Q4_K
        for name, value in weights.items()
        if name.startswith("transformer_blocks.") and value.ndim == 2
    }
    write_dit(target / "transformer" / "dit-Q4_K_M.gguf", weights, types, np.random.default_rng(22))


@pytest.fixture(scope="module")
def quantized_server(workdir):
    """A second `gmlx serve`, at `--quantize 4`, serving the embedded models; the tests use its
    default, its DiT's and text encoder's linear layers quantized to 4 bits as they load."""
    from gmlx_server.engine.families.z_image.embedded import ensure_embedded_model

    elsewhere = workdir / "models-elsewhere"  # a model this server has and the first has not
    elsewhere.mkdir()
    (elsewhere / ELSEWHERE_MODEL).symlink_to(ensure_embedded_model(), target_is_directory=True)
    config = workdir / "quantized.toml"
    config.write_text(f"[server]\nmodel_dirs = [{json.dumps(str(elsewhere))}]\n", encoding="utf-8")
    port = _free_port()
    url, log_path = f"http://127.0.0.1:{port}", workdir / "gmlx-quantized.log"
    command = _gmlx_serve(config, port, "--quantize", str(QUANTIZE_BITS))
    with _started(command, url + "/health", log_path):
        from gmlx_contract.client import StepClient

        client = StepClient(url)
        model = client.models()["default_model"]
        client.load(model)
        assert client.status(model)["quantization"]["dit"]["bits"] == QUANTIZE_BITS
        yield {"url": url, "config": config, "log": log_path, "model": model}


@pytest.fixture(scope="module")
def comfyui(workdir, gmlx_server):
    """ComfyUI with its base directory (custom_nodes, models, user) in the work folder, so
    the checkout itself is never written to."""
    from gmlx_comfy.install import link_pack

    comfy_dir = Path(os.environ["COMFYUI_DIR"]).resolve()
    base = workdir / "comfy"
    for sub in ("custom_nodes", "models/loras", "input", "output"):
        (base / sub).mkdir(parents=True)
    # A fresh install's input folder holds ComfyUI's example picture; the edit example uses it.
    shutil.copy(comfy_dir / "input" / EXAMPLE_PICTURE, base / "input" / EXAMPLE_PICTURE)
    link_pack(base / "custom_nodes")
    stub = workdir / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(MISSING_PACKAGES_STUB, encoding="utf-8")
    port = _free_port()
    env = {
        **os.environ,
        "GMLX_BASE_URL": gmlx_server["url"],
        "GMLX_COMFY_SETTINGS": str(workdir / "comfyui.json"),
        "GMLX_DEFAULT_IMAGE_MODEL": gmlx_server["model"],
        "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]),
    }
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    url, log_path = f"http://127.0.0.1:{port}", workdir / "comfyui.log"
    ready = url + "/object_info/GmlxModelLoader"
    with _started(_comfyui(python, port, base), ready, log_path, cwd=comfy_dir, env=env):
        yield {"url": url, "base": base, "log": log_path}


@pytest.fixture(scope="module")
def engine(gmlx_server):
    """The same model loaded in this process, for direct engine calls."""
    from gmlx_server.model_choice import choose_model

    choice = choose_model(None, gmlx_server["config"])
    loaded = choice.registry.acquire(choice.model_id)
    assert choice.model_id == gmlx_server["model"]
    return loaded.model


@pytest.fixture(scope="module")
def quantized_engine(quantized_server):
    """The quantized server's model loaded in this process at the same precision."""
    from gmlx_server.model_choice import choose_model

    choice = choose_model(None, quantized_server["config"], {"quantize": QUANTIZE_BITS})
    return choice.registry.acquire(choice.model_id).model


@pytest.fixture(scope="module")
def gguf_engine(gmlx_server):
    """The server's Q4_K_M GGUF model loaded in this process."""
    from gmlx_server.model_choice import choose_model

    choice = choose_model(GGUF_MODEL, gmlx_server["config"])
    model = choice.registry.acquire(choice.model_id).model
    assert model.status()["quantization"]["dit"]["types"].keys() >= {"Q4_K", "Q6_K"}
    return model


@functools.cache
def _served_engine(config: Path, model: str):
    """A model the server serves, loaded in this process (once per module's server)."""
    from gmlx_server.model_choice import choose_model

    choice = choose_model(model, config)
    return choice.registry.acquire(choice.model_id).model


@pytest.fixture(scope="module")
def flux2_engine(gmlx_server):
    """The server's tiny FLUX.2 klein model loaded in this process."""
    from gmlx_server.model_choice import choose_model

    choice = choose_model(FLUX2_MODEL, gmlx_server["config"])
    return choice.registry.acquire(choice.model_id).model


# ---------------------------------------------------------------- ComfyUI prompts


def _workflow(name: str, size: int = SIZE) -> dict:
    """An example's API copy as shipped (its model is the server's default), at a small size."""
    return _at_size(api_workflow(name), size)


def _at_size(wf: dict, size: int) -> dict:
    for node in wf.values():
        inputs = node["inputs"]
        for key in ("width", "height"):
            if key in inputs:
                inputs[key] = size
    return wf


def _save_latent(wf: dict, sampler_node: str) -> dict:
    wf["90"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [sampler_node, 0], "filename_prefix": "latents/e2e"},
    }
    return wf


def _queue(comfy: dict, workflow: dict) -> str:
    answer = _json(comfy["url"] + "/prompt", {"prompt": workflow, "client_id": uuid.uuid4().hex})
    return answer["prompt_id"]


def _wait_done(comfy: dict, prompt_id: str, poll_s: float = 0.2) -> dict:
    deadline = time.monotonic() + PROMPT_TIMEOUT_S
    while time.monotonic() < deadline:
        history = _json(f"{comfy['url']}/history/{prompt_id}")
        entry = history.get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None:
            return entry
        time.sleep(poll_s)
    raise TimeoutError(prompt_id)


def _interrupt_reported_ms(comfy: dict, prompt_id: str) -> float:
    """ComfyUI's running prompt interrupted (POST /interrupt): it ends other than a success,
    and the milliseconds until its history reported execution_interrupted."""
    interrupted_at = time.time()
    urllib.request.urlopen(urllib.request.Request(comfy["url"] + "/interrupt", data=b""))
    entry = _wait_done(comfy, prompt_id, poll_s=0.05)
    assert entry["status"]["status_str"] != "success"
    stamps = {m[0]: m[1].get("timestamp") for m in entry["status"]["messages"]}
    return stamps["execution_interrupted"] - interrupted_at * 1000.0


def _run(comfy: dict, workflow: dict) -> dict:
    entry = _wait_done(comfy, _queue(comfy, workflow))
    assert entry["status"]["status_str"] == "success", (
        json.dumps(entry["status"])[-3000:],
        comfy["log"].read_text()[-3000:],
    )
    return entry


def _output_files(comfy: dict, entry: dict, kind: str) -> list[Path]:
    return [
        comfy["base"] / "output" / item.get("subfolder", "") / item["filename"]
        for output in entry["outputs"].values()
        for item in output.get(kind, [])
    ]


def _latent(comfy: dict, entry: dict) -> np.ndarray:
    from safetensors.numpy import load_file

    (path,) = _output_files(comfy, entry, "latents")
    return load_file(path)["latent_tensor"]


def _rgb(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# ---------------------------------------------------------------- example workflow files


def _inputs_in_order(node_info: dict) -> dict:
    """A node type's input specs by name, in the order the frontend makes their widgets."""
    specs = {**node_info["input"].get("required", {}), **node_info["input"].get("optional", {})}
    order = node_info["input_order"]
    return {name: specs[name] for name in order.get("required", []) + order.get("optional", [])}


def _is_widget(spec: list) -> bool:
    return isinstance(spec[0], list) or spec[0] in ("COMBO", "INT", "FLOAT", "STRING", "BOOLEAN")


def _controlled(spec: list) -> bool:
    return (
        len(spec) > 1 and isinstance(spec[1], dict) and bool(spec[1].get("control_after_generate"))
    )


def test_the_example_files_widgets_are_this_comfyuis(comfyui):
    """What the UI -> API conversion assumes of stock ComfyUI holds for this ComfyUI: the node
    types exist, the files list their widgets in this ComfyUI's order, and the unsent widgets
    are the seeds' "control after generate" and the image upload button."""
    info = _json(comfyui["url"] + "/object_info")
    assert STOCK_NODES <= set(info)
    for node_type in STOCK_NODES:
        controlled = {
            n for n, spec in _inputs_in_order(info[node_type]).items() if _controlled(spec)
        }
        assert controlled == {CONTROL_AFTER_GENERATE.get(node_type)} - {None}, node_type
    assert info["LoadImage"]["input"]["required"]["image"][1]["image_upload"] is True
    for name in NAMES:
        for node in ui_workflow(name)["nodes"]:
            if node["type"] in info:
                specs = _inputs_in_order(info[node["type"]])
                shown = [s["widget"]["name"] for s in node.get("inputs", []) if "widget" in s]
                shown = [n for n in shown if n != UPLOAD_BUTTONS.get(node["type"])]
                assert shown == [n for n, spec in specs.items() if _is_widget(spec)], node["type"]


def test_the_sigmas_nodes_zero_values_are_told_in_comfyuis_tooltips(comfyui):
    """What 0 means in the gmlx Sigmas node's steps, width and height reaches the user as
    ComfyUI shows the node's inputs."""
    inputs = _json(comfyui["url"] + "/object_info/GmlxSigmas")["GmlxSigmas"]["input"]
    assert "0: the variant's own step count" in inputs["required"]["steps"][1]["tooltip"]
    for side in ("width", "height"):
        tooltip = inputs["optional"][side][1]["tooltip"]
        assert f"the image's {side} in pixels" in tooltip and "0: not given" in tooltip


# ---------------------------------------------------------------- direct engine calls


def _to_vae_space(model, latents: np.ndarray) -> np.ndarray:
    """Model-space latents as ComfyUI's LATENT carries them (status vae.latents_mean/std; the
    identity where the VAE routes carry model space)."""
    vae = model.status()["vae"]
    if vae.get("space") == "model":
        return latents
    mean = np.asarray(vae["latents_mean"], np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(vae["latents_std"], np.float32).reshape(1, -1, 1, 1)
    return latents * std + mean


def comfy_simple_sigmas(steps: int, shift: float = 1.0) -> np.ndarray:
    """ComfyUI's "simple" schedule for the pack's model sampling (flow, multiplier 1, the
    status's shift): ModelSamplingDiscreteFlow's sigmas are float32 t = k / 1000 for
    k = 1..1000, shifted as time_snr_shift does (shift·t / (1 + (shift − 1)·t))."""
    table = np.arange(1, 1001).astype(np.float32) / np.float32(1000.0)
    if shift != 1.0:
        table = np.float32(shift) * table / (np.float32(1.0) + np.float32(shift - 1.0) * table)
    stride = len(table) / steps
    picked = [table[-(1 + int(x * stride))] for x in range(steps)]
    return np.asarray(picked + [0.0], dtype=np.float32)


def direct_sample(
    model,
    prompt: str,
    seed: int,
    sigmas: np.ndarray,
    table=None,
    sampler: str = "euler",
    cells: tuple[int, int] | None = None,
) -> np.ndarray:
    """The in-process sampler (cfg 1) along `sigmas`, under a patch table, on latents of SIZE²
    pixels or of `cells` (h, w); where those are not whole patches of the DiT, each step pads
    x as ComfyUI's own DiTs do (torch's circular pad, bottom and right) and cuts its answer
    back."""
    from gmlx_server.engine import sampling

    transport = sampling.DirectTransport(model, table=table)
    transport.begin(sigmas)
    row = transport.row(transport.encode(prompt, []))
    latent = model.status()["latent"]
    side = SIZE // int(latent["stride"])
    height, width = cells or (side, side)
    noise = sampling.initial_noise(seed, int(latent["channels"]), height, width)
    patch = int(latent["patch"])

    def step(x, timestep, rows, skip=()):
        pad = (0, -width % patch, 0, -height % patch)
        padded = torch.nn.functional.pad(torch.from_numpy(x), pad, mode="circular").numpy()
        return transport.step(padded, timestep, rows, skip)[:, :, :height, :width]

    try:
        latents = sampling.sample(
            step, noise, sigmas, sampling.Guidance(row, None, 1.0), sampler=sampler
        )
    finally:
        transport.end()
    return _to_vae_space(model, latents)


def direct_generate(model, prompt: str, seed: int, images=()) -> np.ndarray:
    """What `gmlx image sample` computes: the variant's own sigmas, cfg 1."""
    from gmlx_server.engine import sampling

    request = sampling.ImageRequest(
        prompt=prompt, width=SIZE, height=SIZE, seed=seed, cfg=1.0, images=tuple(images)
    )
    latents, _ = sampling.generate(sampling.DirectTransport(model), model.status(), request)
    return _to_vae_space(model, latents)


# ---------------------------------------------------------------- text to image


def test_text_to_image_equals_gmlx_image_sample(comfyui, gmlx_server, engine, workdir):
    """Stock RandomNoise + CFGGuider + euler SamplerCustomAdvanced over gmlx Sigmas."""
    seed = 3
    wf = _save_latent(_workflow("gmlx_text_to_image"), "11")
    wf["8"]["inputs"]["noise_seed"] = seed
    prompt = wf["4"]["inputs"]["text"]
    entry = _run(comfyui, wf)
    got = _latent(comfyui, entry)
    want = direct_generate(engine, prompt, seed)
    assert got.shape == want.shape
    assert _rel(got, want) <= LATENT_RTOL

    out = workdir / "direct.png"
    subprocess.run(
        [sys.executable, "-m", "gmlx_server", "image", "sample"]
        + ["--config", str(gmlx_server["config"]), "--prompt", prompt]
        + ["--width", str(SIZE), "--height", str(SIZE), "--cfg", "1", "--seed", str(seed)]
        + ["--out", str(out)],
        check=True,
    )
    (image,) = _output_files(comfyui, entry, "images")
    assert np.abs(_rgb(image) - _rgb(out)).max() <= PIXEL_TOLERANCE


def test_text_to_image_on_a_q4_k_m_gguf_dit_equals_the_engines_generate(
    comfyui, gmlx_server, gguf_engine
):
    """The text-to-image example with its loader on a model whose DiT is a Q4_K_M GGUF file,
    held as the file's blocks by the server."""
    seed = 4
    wf = _on_model(_save_latent(_workflow("gmlx_text_to_image"), "11"), GGUF_MODEL)
    wf["8"]["inputs"]["noise_seed"] = seed
    got = _latent(comfyui, _run(comfyui, wf))
    want = direct_generate(gguf_engine, wf["4"]["inputs"]["text"], seed)
    assert got.shape == want.shape
    assert _rel(got, want) <= LATENT_RTOL


@pytest.mark.parametrize(
    ("example", "model"),
    [("gmlx_z_image_text_to_image", Z_IMAGE_MODEL), ("gmlx_krea2_text_to_image", KREA2_MODEL)],
)
def test_an_embedded_family_example_equals_the_engines_generate(
    comfyui, gmlx_server, example, model
):
    """The Z-Image and Krea 2 text-to-image examples as shipped (their loaders on the family's
    embedded model): gmlx Sigmas gives the turbo variant's steps and cfg (8, 1) on ComfyUI's
    "simple" schedule at the status's shift."""
    seed = 9
    engine = _served_engine(gmlx_server["config"], model)
    wf = _save_latent(_workflow(example), "11")
    assert {wf[loader]["inputs"]["model_name"] for loader in ("1", "2", "3")} == {model}
    wf["8"]["inputs"]["noise_seed"] = seed
    got = _latent(comfyui, _run(comfyui, wf))
    want = direct_generate(engine, wf["4"]["inputs"]["text"], seed)
    assert got.shape == want.shape == (1, 16, SIZE // 8, SIZE // 8)
    print(f"{example} against the engine's generate: rel L2 {_rel(got, want):.1e}")
    assert _rel(got, want) <= LATENT_RTOL


def guided_generate(model, prompt: str, seed: int, steps: int) -> np.ndarray:
    """`gmlx image sample` with the variant's own guidance and an empty negative prompt (for
    MOSS-Image: cfg 3, the negative pass leaving out its `neg_skip` blocks)."""
    from gmlx_server.engine import sampling

    request = sampling.ImageRequest(
        prompt=prompt, width=SIZE, height=SIZE, seed=seed, steps=steps, negative=""
    )
    latents, _ = sampling.generate(sampling.DirectTransport(model), model.status(), request)
    return _to_vae_space(model, latents)


def test_the_moss_image_example_equals_the_engines_guided_generate(comfyui, gmlx_server):
    """The MOSS-Image example as shipped (loaders on the embedded moss-image-random-tiny, gmlx
    Sigmas on the pipeline's snapped schedule and cfg 3, stock CFGGuider, and ComfyUI's own
    SkipLayerGuidanceDiTSimple on block 22), at 6 steps: the pack sends the negative rows'
    calls with `skip` [22], the engine's guided sampling skips `neg_skip` [22], and the two
    agree. Bypassing the skip-layer node gives another image."""
    seed, steps = 6, 6
    engine = _served_engine(gmlx_server["config"], MOSS_MODEL)
    wf = _save_latent(_workflow("gmlx_moss_image_text_to_image"), "11")
    assert {wf[loader]["inputs"]["model_name"] for loader in ("1", "2", "3")} == {MOSS_MODEL}
    assert wf["14"]["class_type"] == "SkipLayerGuidanceDiTSimple"
    wf["8"]["inputs"]["noise_seed"] = seed
    wf["7"]["inputs"]["steps"] = steps
    got = _latent(comfyui, _run(comfyui, wf))
    want = guided_generate(engine, wf["4"]["inputs"]["text"], seed, steps)
    assert got.shape == want.shape == (1, 128, SIZE // 16, SIZE // 16)
    print(f"MOSS-Image example against the engine's guided generate: rel L2 {_rel(got, want):.1e}")
    assert _rel(got, want) <= LATENT_RTOL
    wf["9"]["inputs"]["model"] = ["1", 0]  # the skip-layer node left out
    del wf["14"]
    plain = _latent(comfyui, _run(comfyui, wf))
    assert _rel(plain, want) > 100 * LATENT_RTOL


def test_stock_ksampler_euler_simple_equals_the_in_process_sampler(comfyui, gmlx_server, engine):
    """The stock KSampler (its own noise and "simple" sigmas) against the engine's sampler
    started from the same seed along the same sigmas."""
    seed, steps = 11, 6
    wf = _save_latent(_workflow("gmlx_lora"), "11")
    wf["11"]["inputs"].update(seed=seed, steps=steps)
    got = _latent(comfyui, _run(comfyui, wf))
    want = direct_sample(engine, wf["4"]["inputs"]["text"], seed, comfy_simple_sigmas(steps))
    assert _rel(got, want) <= LATENT_RTOL


@pytest.mark.parametrize(
    ("model", "comfy_class"), [(Z_IMAGE_MODEL, "ZImage"), (KREA2_MODEL, "Krea2")]
)
def test_stock_ksampler_on_a_pack_built_model_equals_the_in_process_sampler(
    comfyui, gmlx_server, model, comfy_class
):
    """The stock KSampler (euler, "simple") on the server's Z-Image and Krea 2 models: ComfyUI's
    model class where it has one (Z-Image on 0.33 and newer), the pack's own otherwise (Krea 2
    on every ComfyUI); the status's shift (Z-Image turbo 3, Krea 2 turbo e^1.15) shapes the
    sigmas on both sides."""
    seed, steps = 5, 4
    engine = _served_engine(gmlx_server["config"], model)
    wf = _save_latent(_workflow("gmlx_lora"), "11")
    for loader in ("1", "2", "3"):
        wf[loader]["inputs"]["model_name"] = model
    wf["11"]["inputs"].update(seed=seed, steps=steps)
    got = _latent(comfyui, _run(comfyui, wf))
    status = engine.status()
    assert status["comfy"]["model_class"] == comfy_class
    sigmas = comfy_simple_sigmas(steps, status["sampling"]["shift"])
    want = direct_sample(engine, wf["4"]["inputs"]["text"], seed, sigmas)
    assert got.shape == want.shape == (1, 16, SIZE // 8, SIZE // 8)
    print(f"{model} stock KSampler against the engine's sampler: rel L2 {_rel(got, want):.1e}")
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, direct_sample(engine, "", seed, sigmas)) > 100 * LATENT_RTOL


def test_a_single_frame_video_latent_steps_as_the_image_latent(comfyui, gmlx_server):
    """Krea 2 sampled from a stock single-frame video latent (EmptyHunyuanLatentVideo, length 1:
    (1, 16, 1, h, w)): each step sends x squeezed to 4-D and gives the frame back, so the
    sampling is the image latent's, the same noise in the same order."""
    wf = _save_latent(_workflow("gmlx_lora"), "11")
    for loader in ("1", "2", "3"):
        wf[loader]["inputs"]["model_name"] = KREA2_MODEL
    wf["11"]["inputs"].update(seed=3, steps=2)
    image = _latent(comfyui, _run(comfyui, wf))
    wf["6"] = {
        "class_type": "EmptyHunyuanLatentVideo",
        "inputs": {"width": SIZE, "height": SIZE, "length": 1, "batch_size": 1},
    }
    video = _latent(comfyui, _run(comfyui, wf))
    assert video.shape == (1, 16, 1, SIZE // 8, SIZE // 8)
    np.testing.assert_allclose(video[:, :, 0], image, rtol=0, atol=1e-5)


def test_a_stock_latent_of_sides_off_z_images_patch_samples_as_comfyuis_own_dits_would(
    comfyui, gmlx_server
):
    """A stock EmptyLatentImage of 200×152 pixels (25×19 cells, not whole 2×2 patches of
    Z-Image's DiT), as a photo of such a size encodes to: each step pads x as ComfyUI's own
    DiTs pad theirs and cuts the answer back, equal to the engine's sampler doing the same."""
    seed, steps = 5, 3
    engine = _served_engine(gmlx_server["config"], Z_IMAGE_MODEL)
    wf = _save_latent(_workflow("gmlx_lora"), "11")
    for loader in ("1", "2", "3"):
        wf[loader]["inputs"]["model_name"] = Z_IMAGE_MODEL
    assert wf["6"]["class_type"] == "GmlxEmptyLatent"
    wf["6"] = {
        "class_type": "EmptyLatentImage",
        "inputs": {"width": 200, "height": 152, "batch_size": 1},
    }
    wf["11"]["inputs"].update(seed=seed, steps=steps)
    got = _latent(comfyui, _run(comfyui, wf))
    sigmas = comfy_simple_sigmas(steps, engine.status()["sampling"]["shift"])
    want = direct_sample(engine, wf["4"]["inputs"]["text"], seed, sigmas, cells=(19, 25))
    assert got.shape == want.shape == (1, 16, 19, 25)
    assert _rel(got, want) <= LATENT_RTOL


def flux2_sample(
    model, prompt: str, seed: int, sigmas, refs=(), ref_cache=False, table=None, schedule=None
) -> np.ndarray:
    """The in-process euler sampler (cfg 1) along `sigmas` under the comfy convention, the row
    carrying reference latents (model space) and, with `ref_cache`, the run's reference K/V;
    every step under a patch table. A flow-map DiT's steps (FLUX.3 klein's) name `schedule`
    as their `sample_sigmas` (default: `sigmas`, what ComfyUI's samplers send)."""
    from gmlx_server.engine import sampling

    row = sampling.direct_row(
        type(
            "Encoding",
            (),
            {
                "cond": model.encode(prompt, [], False).cond,
                "ref_latents": list(refs),
                "image_slots": [],
            },
        )
    )
    latent = model.status()["latent"]
    side = SIZE // int(latent["stride"])
    noise = sampling.initial_noise(seed, int(latent["channels"]), side, side)
    run = "e2e-" + uuid.uuid4().hex[:8]

    flow_map = model.capabilities.flow_map
    sample_sigmas = np.asarray(sigmas if schedule is None else schedule, np.float32)

    def step(x, timestep, rows):
        return model.denoise_step(
            x,
            timestep,
            list(rows),
            convention="comfy",
            run=run,
            ref_cache=ref_cache,
            table=table,
            sample_sigmas=sample_sigmas if flow_map else None,
        ).out

    try:
        return sampling.sample(step, noise, sigmas, sampling.Guidance(row, None, 1.0))
    finally:
        model.end_run(run)


def _flux2_reference_prompt(seed: int, steps: int, kv_cache: bool) -> dict:
    """The pack's prompt on FLUX.2 klein with two LoadImage references encoded by the gmlx VAE
    (stock VAEEncode) and attached by the stock ReferenceLatent node; with `kv_cache` the model
    goes through ComfyUI's Flux KV Cache node."""
    wf = _pack_prompt(FLUX2_MODEL, seed, steps)
    previous = ["4", 0]
    for i, node in enumerate(("30", "31"), start=1):
        wf[f"{node}0"] = {"class_type": "LoadImage", "inputs": {"image": f"flux2_ref_{i}.png"}}
        wf[f"{node}1"] = {
            "class_type": "VAEEncode",
            "inputs": {"pixels": [f"{node}0", 0], "vae": ["3", 0]},
        }
        wf[node] = {
            "class_type": "ReferenceLatent",
            "inputs": {"conditioning": previous, "latent": [f"{node}1", 0]},
        }
        previous = [node, 0]
    wf["11"]["inputs"]["positive"] = previous
    if kv_cache:
        wf["40"] = {"class_type": "FluxKVCache", "inputs": {"model": ["1", 0]}}
        wf["11"]["inputs"]["model"] = ["40", 0]
    return wf


def test_stock_ksampler_on_flux2_klein_equals_the_in_process_sampler(
    comfyui, gmlx_server, flux2_engine
):
    """The stock KSampler (euler, "simple", cfg 1) on the server's FLUX.2 klein model: LATENT
    in model space (128 channels at stride 16), ComfyUI's Flux2 class where it has one."""
    seed, steps = 4, 3
    got = _latent(
        comfyui, _run(comfyui, _save_latent(_pack_prompt(FLUX2_MODEL, seed, steps), "11"))
    )
    status = flux2_engine.status()
    assert status["comfy"]["model_class"] == "Flux2" and status["vae"]["space"] == "model"
    sigmas = comfy_simple_sigmas(steps, status["sampling"]["shift"])
    want = flux2_sample(flux2_engine, PACK_PROMPT, seed, sigmas)
    assert got.shape == want.shape == (1, 128, SIZE // 16, SIZE // 16)
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, flux2_sample(flux2_engine, "", seed, sigmas)) > 100 * LATENT_RTOL


def _flux2_references(comfyui, flux2_engine) -> list[np.ndarray]:
    from PIL import Image

    rng = np.random.default_rng(8)
    refs = []
    for i, (h, w) in enumerate([(64, 64), (96, 64)], start=1):
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(image).save(comfyui["base"] / "input" / f"flux2_ref_{i}.png")
        refs.append(flux2_engine.vae_encode(image.astype(np.float32) / np.float32(255))[None])
    return refs


def test_flux2_klein_with_two_stock_reference_latents(comfyui, gmlx_server, flux2_engine):
    """Two references through the gmlx VAE and the stock ReferenceLatent node: the server's
    step with those latents as the row's references."""
    refs = _flux2_references(comfyui, flux2_engine)
    seed, steps = 6, 3
    wf = _save_latent(_flux2_reference_prompt(seed, steps, kv_cache=False), "11")
    got = _latent(comfyui, _run(comfyui, wf))
    sigmas = comfy_simple_sigmas(steps, flux2_engine.status()["sampling"]["shift"])
    want = flux2_sample(flux2_engine, PACK_PROMPT, seed, sigmas, refs)
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, flux2_sample(flux2_engine, PACK_PROMPT, seed, sigmas)) > 100 * LATENT_RTOL


def test_comfy_flux_kv_cache_node_is_the_servers_ref_cache(comfyui, gmlx_server, flux2_engine):
    """ComfyUI's Flux KV Cache node (where this ComfyUI has it) on the pack's model: the pack
    checks the ref_cache feature and sends ref_cache, so the run keeps the references' K/V."""
    comfy_dir = Path(os.environ["COMFYUI_DIR"])
    if "FluxKVCache" not in (comfy_dir / "comfy_extras" / "nodes_flux.py").read_text():
        pytest.skip("this ComfyUI has no Flux KV Cache node")
    refs = _flux2_references(comfyui, flux2_engine)
    seed, steps = 6, 3
    wf = _save_latent(_flux2_reference_prompt(seed, steps, kv_cache=True), "11")
    got = _latent(comfyui, _run(comfyui, wf))
    sigmas = comfy_simple_sigmas(steps, flux2_engine.status()["sampling"]["shift"])
    want = flux2_sample(flux2_engine, PACK_PROMPT, seed, sigmas, refs, ref_cache=True)
    assert _rel(got, want) <= LATENT_RTOL
    joint = flux2_sample(flux2_engine, PACK_PROMPT, seed, sigmas, refs)
    assert _rel(want, joint) > 100 * LATENT_RTOL


def _on_model(wf: dict, model: str) -> dict:
    """The workflow with every loader on `model`."""
    for node in wf.values():
        if "model_name" in node["inputs"]:
            node["inputs"]["model_name"] = model
    return wf


def test_flux2_klein_text_to_image_example_equals_the_in_process_sampler(
    comfyui, gmlx_server, flux2_engine
):
    """The FLUX.2 klein text-to-image example with its loaders on the server's tiny klein: the
    stock KSampler's 4 euler steps on "simple" at cfg 1."""
    seed = 5
    wf = _on_model(_save_latent(_workflow("gmlx_flux2_klein_text_to_image"), "11"), FLUX2_MODEL)
    wf["11"]["inputs"]["seed"] = seed
    got = _latent(comfyui, _run(comfyui, wf))
    steps = wf["11"]["inputs"]["steps"]
    sigmas = comfy_simple_sigmas(steps, flux2_engine.status()["sampling"]["shift"])
    want = flux2_sample(flux2_engine, wf["4"]["inputs"]["text"], seed, sigmas)
    assert got.shape == want.shape == (1, 128, SIZE // 16, SIZE // 16)
    assert _rel(got, want) <= LATENT_RTOL


def test_flux2_klein_examples_as_shipped_run_on_the_embedded_klein(comfyui, gmlx_server):
    """Both FLUX.2 klein examples as shipped: their loaders name the server's embedded klein,
    so they run on a fresh install."""
    for name in ("gmlx_flux2_klein_text_to_image", "gmlx_flux2_klein_edit_two_references"):
        wf = _save_latent(_workflow(name), "11")
        assert {wf[loader]["inputs"]["model_name"] for loader in ("1", "2", "3")} == {
            "flux2-klein-random-tiny"
        }
        got = _latent(comfyui, _run(comfyui, wf))
        assert got.shape == (1, 128, SIZE // 16, SIZE // 16) and np.isfinite(got).all()


def test_flux2_klein_edit_example_with_two_references(comfyui, gmlx_server, flux2_engine):
    """The FLUX.2 klein edit example with its loaders on the server's tiny klein and its two
    LoadImage nodes on two pictures: the server's step with their VAE latents as the row's
    references, in the order of the ReferenceLatent chain."""
    refs = _flux2_references(comfyui, flux2_engine)
    seed = 7
    wf = _save_latent(_workflow("gmlx_flux2_klein_edit_two_references"), "11")
    wf = _on_model(wf, FLUX2_MODEL)
    wf["11"]["inputs"]["seed"] = seed
    for node_id, i in (("20", 1), ("21", 2)):
        wf[node_id]["inputs"]["image"] = f"flux2_ref_{i}.png"
    got = _latent(comfyui, _run(comfyui, wf))
    steps = wf["11"]["inputs"]["steps"]
    sigmas = comfy_simple_sigmas(steps, flux2_engine.status()["sampling"]["shift"])
    prompt = wf["4"]["inputs"]["text"]
    want = flux2_sample(flux2_engine, prompt, seed, sigmas, refs)
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, flux2_sample(flux2_engine, prompt, seed, sigmas)) > 100 * LATENT_RTOL


@pytest.fixture(scope="module")
def flux3_engine(gmlx_server):
    """The server's embedded FLUX.3 klein (distilled: a flow map) loaded in this process."""
    return _served_engine(gmlx_server["config"], FLUX3_KLEIN_MODEL)


def test_the_flux3_klein_example_equals_the_in_process_flow_map_sampler(
    comfyui, gmlx_server, flux3_engine
):
    """The FLUX.3 klein text-to-image example as shipped (its loaders on the embedded
    flux3-klein-random-tiny; the pack's own Flux3 model, which no ComfyUI has): the stock
    KSampler's 16 euler steps on "simple" at the status's shift 6.93, each step sending
    ComfyUI's schedule (`sample_sigmas`), which decides every step's jump."""
    seed = 5
    wf = _save_latent(_workflow("gmlx_flux3_klein_text_to_image"), "11")
    assert {wf[loader]["inputs"]["model_name"] for loader in ("1", "2", "3")} == {FLUX3_KLEIN_MODEL}
    wf["11"]["inputs"]["seed"] = seed
    got = _latent(comfyui, _run(comfyui, wf))
    status = flux3_engine.status()
    assert status["comfy"]["model_class"] == "Flux3" and status["sampling"]["flow_map"]
    steps, prompt = wf["11"]["inputs"]["steps"], wf["4"]["inputs"]["text"]
    sigmas = comfy_simple_sigmas(steps, status["sampling"]["shift"])
    want = flux2_sample(flux3_engine, prompt, seed, sigmas)
    assert got.shape == want.shape == (1, 128, SIZE // 16, SIZE // 16)
    print(f"FLUX.3 klein stock KSampler against the engine's sampler: rel L2 {_rel(got, want):.1e}")
    assert _rel(got, want) <= LATENT_RTOL
    other = flux2_sample(flux3_engine, prompt, seed, sigmas, schedule=np.linspace(1, 0, steps + 1))
    assert _rel(want, other) > 100 * LATENT_RTOL  # the schedule sent moved the jumps


def test_the_flux3_klein_edit_example_with_two_references(comfyui, gmlx_server, flux3_engine):
    """The FLUX.3 klein edit example as shipped, its two LoadImage nodes on two pictures: the
    server's flow-map steps with their VAE latents as the row's references, in the order of the
    ReferenceLatent chain."""
    refs = _flux2_references(comfyui, flux3_engine)
    seed = 7
    wf = _save_latent(_workflow("gmlx_flux3_klein_edit_two_references"), "11")
    wf["11"]["inputs"]["seed"] = seed
    for node_id, i in (("20", 1), ("21", 2)):
        wf[node_id]["inputs"]["image"] = f"flux2_ref_{i}.png"
    got = _latent(comfyui, _run(comfyui, wf))
    steps, prompt = wf["11"]["inputs"]["steps"], wf["4"]["inputs"]["text"]
    sigmas = comfy_simple_sigmas(steps, flux3_engine.status()["sampling"]["shift"])
    want = flux2_sample(flux3_engine, prompt, seed, sigmas, refs)
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, flux2_sample(flux3_engine, prompt, seed, sigmas)) > 100 * LATENT_RTOL


def test_stock_ksampler_uni_pc_bh2_equals_the_in_process_sampler(comfyui, gmlx_server, engine):
    """KSampler's uni_pc_bh2 samples along steps + 1 sigmas less the penultimate one (its
    DISCARD_PENULTIMATE_SIGMA_SAMPLERS); the engine's uni_pc_bh2 along those sigmas agrees to
    ComfyUI's float32 rounding."""
    seed, steps = 4, 6
    wf = _save_latent(_workflow("gmlx_lora"), "11")
    wf["11"]["inputs"].update(seed=seed, steps=steps, sampler_name="uni_pc_bh2")
    got = _latent(comfyui, _run(comfyui, wf))
    sigmas = comfy_simple_sigmas(steps + 1)
    sigmas = np.concatenate([sigmas[:-2], sigmas[-1:]])
    prompt = wf["4"]["inputs"]["text"]
    want = direct_sample(engine, prompt, seed, sigmas, sampler="uni_pc_bh2")
    assert _rel(got, want) <= UNIPC_LATENT_RTOL
    assert _rel(want, direct_sample(engine, prompt, seed, sigmas)) > 100 * UNIPC_LATENT_RTOL


# ---------------------------------------------------------------- LoRA


def _lora_file(engine, path: Path):
    """A LoRA on three linear weights of the tiny DiT (two of them fused on the server as
    one qkv weight), in ComfyUI's generic key form; and the server-side table it means at
    LORA_STRENGTH, built directly from the same matrices."""
    from gmlx_server.service import LoraPatch, PatchEntry, PatchTable
    from safetensors.numpy import save_file

    shapes = {t["name"]: t["shape"] for t in engine.manifest()["tensors"]}
    layers = [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_v",
        "transformer_blocks.1.attn.to_out.0",
    ]
    rng = np.random.default_rng(0)
    tensors, entries = {}, []
    for layer in layers:
        out_dim, in_dim = shapes[layer + ".weight"]
        up = (rng.standard_normal((out_dim, LORA_RANK)) * 0.3).astype(np.float32)
        down = (rng.standard_normal((LORA_RANK, in_dim)) * 0.3).astype(np.float32)
        tensors[f"diffusion_model.{layer}.lora_up.weight"] = up
        tensors[f"diffusion_model.{layer}.lora_down.weight"] = down
        tensors[f"diffusion_model.{layer}.alpha"] = np.array(LORA_ALPHA, np.float32)
        patch = LoraPatch(up=up, down=down, scale=LORA_ALPHA / LORA_RANK, strength=LORA_STRENGTH)
        entries.append(PatchEntry(key=layer + ".weight", layer=layer, band=None, patches=(patch,)))
    save_file(tensors, path)
    return PatchTable(table_id="e2e-direct", model_id=engine.model_id, entries=tuple(entries))


def _lora_enabled(lora_name: str, strength: float) -> dict:
    """The LoRA example as a user enables it: the LoRA node un-bypassed, a file picked."""
    ui = ui_workflow("gmlx_lora")
    (lora,) = [node for node in ui["nodes"] if node["type"] == "LoraLoaderModelOnly"]
    lora["mode"] = 0
    lora["widgets_values"] = [lora_name, strength]
    return _at_size(ui_to_api(ui), SIZE)


def test_lora_changes_the_output_as_the_server_table_does(comfyui, gmlx_server, engine):
    """LoraLoaderModelOnly + stock KSampler against the engine under the same table."""
    seed, steps = 5, 8
    table = _lora_file(engine, comfyui["base"] / "models" / "loras" / "gmlx_e2e.safetensors")
    wf = _save_latent(_lora_enabled("gmlx_e2e.safetensors", LORA_STRENGTH), "11")
    wf["11"]["inputs"].update(seed=seed, steps=steps)
    prompt, sigmas = wf["4"]["inputs"]["text"], comfy_simple_sigmas(steps)

    with_lora = _latent(comfyui, _run(comfyui, wf))
    want = direct_sample(engine, prompt, seed, sigmas, table)
    plain = direct_sample(engine, prompt, seed, sigmas)
    assert _rel(with_lora, want) <= LATENT_RTOL
    assert _rel(want, plain) > 1000 * LATENT_RTOL  # the LoRA really moves the output

    wf["30"]["inputs"]["strength_model"] = 0.0  # strength 0: no table at all
    assert _rel(_latent(comfyui, _run(comfyui, wf)), plain) <= LATENT_RTOL


# ---------------------------------------------------------------- edit


def test_edit_with_two_references(comfyui, gmlx_server, engine):
    """Two LoadImage references through the gmlx edit encode node. The images are already of
    a size the server encodes as is, so both paths see the same pixels."""
    from PIL import Image

    rng = np.random.default_rng(1)
    refs = [
        rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
        rng.integers(0, 256, (256, 320, 3), dtype=np.uint8),
    ]
    for i, ref in enumerate(refs, start=1):
        Image.fromarray(ref).save(comfyui["base"] / "input" / f"reference_{i}.png")
    seed = 2
    wf = _save_latent(_workflow("gmlx_edit_two_references"), "11")
    wf["8"]["inputs"]["noise_seed"] = seed
    for node_id, i in (("20", 1), ("21", 2)):
        wf[node_id]["inputs"]["image"] = f"reference_{i}.png"
    prompt = wf["4"]["inputs"]["prompt"]
    got = _latent(comfyui, _run(comfyui, wf))
    want = direct_generate(engine, prompt, seed, refs)
    without_refs = direct_generate(engine, prompt, seed)
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, without_refs) > 1000 * LATENT_RTOL


# ---------------------------------------------------------------- interrupt


def _steps_logged(log: Path) -> list[tuple[int, float]]:
    return [(int(m[1]), float(m[2])) for m in STEP_LINE.finditer(log.read_text())]


def _unload(gmlx_server: dict) -> dict:
    from gmlx_contract.client import StepClient

    return StepClient(gmlx_server["url"]).unload(gmlx_server["model"])


def test_a_model_whose_files_changed_since_its_loader_ran_is_refused_at_sampling(
    comfyui, gmlx_server, workdir
):
    """ComfyUI keeps the loaders' outputs from prompt to prompt: where the server's model of
    that id has come to be another (here its folder now holds the base variant, shift 6), the
    next sampling is refused, naming what changed, rather than run with the old shift."""
    from gmlx_contract.client import StepClient
    from gmlx_server.engine.families.z_image.embedded import ensure_embedded_model

    folder = workdir / "models" / "z-image-changing"
    shutil.copytree(ensure_embedded_model(), folder)
    wf = _on_server(_pack_prompt(folder.name, seed=1, steps=2), gmlx_server["url"])
    _run(comfyui, wf)
    scheduler = folder / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "shift": 6.0}))
    later = time.time() + 5
    os.utime(folder / "model_index.json", (later, later))  # the registry looks at it again
    StepClient(gmlx_server["url"]).unload(folder.name)
    time.sleep(2.5)  # past the registry's listing time to live
    wf["11"]["inputs"]["seed"] = 2  # the sampler runs again, the loaders' outputs are kept
    message = _failure(comfyui, wf)
    assert f"the server's '{folder.name}' is no longer the model this MODEL was loaded" in message
    assert "its variant, sampling.shift changed" in message


def test_interrupt_stops_the_prompt_and_frees_the_server(comfyui, gmlx_server):
    from gmlx_contract.errors import StepError

    wf = _workflow("gmlx_lora", size=INTERRUPT_SIZE)
    wf["11"]["inputs"].update(steps=500, seed=int(time.time()))
    before = len(_steps_logged(gmlx_server["log"]))
    prompt_id = _queue(comfyui, wf)
    # Wait for two finished steps, then interrupt halfway through the next one.
    deadline = time.monotonic() + PROMPT_TIMEOUT_S
    while len(_steps_logged(gmlx_server["log"])) < before + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    step_ms = _steps_logged(gmlx_server["log"])[-1][1]
    time.sleep(step_ms / 2000.0)
    latency_ms = _interrupt_reported_ms(comfyui, prompt_id)
    print(f"interrupt reported {latency_ms:.0f} ms after /interrupt (steps of {step_ms} ms)")
    # The pack raises ComfyUI's interrupt while the step is still on the server.
    assert latency_ms < min(500.0, step_ms / 2), (latency_ms, step_ms)
    assert "/interrupt 200" in gmlx_server["log"].read_text()

    # The server discards the abandoned step (409) and holds no run: the model unloads.
    deadline = time.monotonic() + 60
    while True:
        try:
            assert _unload(gmlx_server)["unloaded"] is True
            break
        except StepError as err:  # 409 busy until the abandoned step ends
            assert err.status == 409 and time.monotonic() < deadline
            time.sleep(0.2)
    assert _steps_logged(gmlx_server["log"])[-1][0] == 409

    quick = _workflow("gmlx_text_to_image")
    _run(comfyui, quick)


# ---------------------------------------------------------------- no server yet: list and start


@contextlib.contextmanager
def _comfyui_of_its_own(workdir: Path, base: Path, **environment: str):
    """A ComfyUI of its own in `base`, the pack linked, with the `gmlx` command to start a
    server and no GMLX_ variable but `environment`'s (`workdir`: the stand-in modules)."""
    from gmlx_comfy.install import link_pack

    for sub in ("custom_nodes", "input", "output"):
        (base / sub).mkdir(parents=True)
    link_pack(base / "custom_nodes")
    stub = workdir / "stub"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GMLX_")},
        "GMLX_SITE": os.environ.get("GMLX_SITE", ""),
        "GMLX_COMFY_SETTINGS": str(base / "comfyui.json"),
        "GMLX_COMMAND": shlex.join([sys.executable, "-m", "gmlx_server"]),
        "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]),
        **environment,
    }
    port = _free_port()
    url, log_path = f"http://127.0.0.1:{port}", base / "comfyui.log"
    command = _comfyui(os.environ.get("COMFYUI_PYTHON", sys.executable), port, base)
    ready, comfy_dir = url + "/object_info/GmlxModelLoader", os.environ["COMFYUI_DIR"]
    with _started(command, ready, log_path, cwd=Path(comfy_dir).resolve(), env=env) as proc:
        yield {"url": url, "base": base, "log": log_path, "proc": proc}


@pytest.fixture
def comfyui_alone(workdir, gmlx_server, comfyui, tmp_path):
    """A second ComfyUI of its own for each test, pointed at a port where nothing listens, with
    the `gmlx` command to start a server there (`gmlx_server` has generated the embedded
    default model; `comfyui` has written the stand-in modules to workdir/stub)."""
    gmlx_url = f"http://127.0.0.1:{_free_port()}"
    with _comfyui_of_its_own(workdir, tmp_path / "alone", GMLX_BASE_URL=gmlx_url) as comfy:
        yield {**comfy, "gmlx_url": gmlx_url}


def test_a_server_started_by_hand_elsewhere_is_the_one_the_pack_uses(
    workdir, gmlx_server, comfyui, tmp_path
):
    """No URL set anywhere, the configured port silent, and a `gmlx serve` started by hand on
    another port with a config of its own: the pack finds it through `gmlx status` (the
    server's record) and starts no second server."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    configured = home / ".config" / "gmlx-steps" / "config.toml"
    configured.parent.mkdir(parents=True)
    configured.write_text(f"[server]\nport = {_free_port()}\n", encoding="utf-8")
    by_hand = tmp_path / "by-hand.toml"
    models = json.dumps(str(gmlx_server["config"].parent / "models"))
    by_hand.write_text(f"[server]\nmodel_dirs = [{models}]\n", encoding="utf-8")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve_env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    with _started(
        _gmlx_serve(by_hand, port), url + "/health", tmp_path / "hand.log", env=serve_env
    ):
        paths = {"HOME": str(home), "XDG_CACHE_HOME": str(cache)}
        with _comfyui_of_its_own(workdir, tmp_path / "comfy", **paths) as comfy:
            workflow = {
                "1": {
                    "class_type": "GmlxServerStatus",
                    "inputs": {"model_name": FLUX2_MODEL, "server_url": "", "start_server": True},
                }
            }
            entry = _run(comfy, workflow)
    (text,) = entry["outputs"]["1"]["text"]
    assert text.startswith(f"server {url}: gmlx ")
    assert f"model {FLUX2_MODEL}: flux2_klein" in text
    assert not (comfy["base"] / "server.log").exists()  # nothing started


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def _stop_started_server(gmlx_url: str) -> None:
    """Stop the `gmlx serve` the pack started for `gmlx_url`, as a crash or a user would (its
    parent, ComfyUI, reaps it later: the test waits for the port to fall silent)."""
    import psutil

    port = gmlx_url.rsplit(":", 1)[1]
    for proc in psutil.process_iter(["cmdline"]):
        line = proc.info["cmdline"] or []
        if "serve" in line and line[line.index("serve") :][-2:] == ["--port", port]:
            proc.terminate()
    deadline = time.monotonic() + 30
    while _answers(gmlx_url):
        assert time.monotonic() < deadline, f"the server at {gmlx_url} still answers"
        time.sleep(0.2)


def test_a_lora_added_after_the_started_server_stopped_starts_it_again(
    comfyui_alone, gmlx_server, engine
):
    """The server the pack started stops between two prompts, and the second adds a LoRA:
    ComfyUI's cached loaders and encodings reach no server, so the model's load (its patch
    table) is the first to find it gone. It starts the server again and samples as the
    server's own loader does."""
    comfy, gmlx_url = comfyui_alone, comfyui_alone["gmlx_url"]
    seed, steps = 7, 2
    path = _lora_files(engine, comfy["base"] / "models" / "loras")["diffusers"]
    wf = _pack_prompt(gmlx_server["model"], seed, steps)
    try:
        _run(comfy, wf)
        _stop_started_server(gmlx_url)
        with _LogSlice(comfy["log"]) as log:
            entry = _run(comfy, _with_lora(wf, "diffusers/lora.safetensors"))
    finally:
        _stop_started_server(gmlx_url)
    assert "no longer answers; connecting again" in log.text
    want = direct_sample(
        engine, PACK_PROMPT, seed, comfy_simple_sigmas(steps), _server_table(engine, path)
    )
    assert _rel(_latent(comfy, entry), want) <= LATENT_RTOL


def test_with_the_server_down_the_loader_lists_the_configured_models_and_starts_it(
    comfyui_alone, gmlx_server
):
    comfy, gmlx_url = comfyui_alone, comfyui_alone["gmlx_url"]
    info = _json(comfy["url"] + "/object_info/GmlxModelLoader")["GmlxModelLoader"]
    # the embedded models, the default first
    embedded = [
        gmlx_server["model"],
        FLUX2_KLEIN_MODEL,
        FLUX3_KLEIN_MODEL,
        KREA2_MODEL,
        MOSS_MODEL,
        Z_IMAGE_MODEL,
    ]
    assert info["input"]["required"]["model_name"][0] == embedded

    workflow = {
        "1": {
            "class_type": "GmlxServerStatus",
            "inputs": {"model_name": gmlx_server["model"], "server_url": "", "start_server": True},
        }
    }
    entry = _run(comfy, workflow)
    (text,) = entry["outputs"]["1"]["text"]
    assert text.startswith(f"server {gmlx_url}: gmlx ")
    server_log = (comfy["base"] / "server.log").read_text()
    assert f"serve --host 127.0.0.1 --port {gmlx_url.rsplit(':', 1)[1]}" in server_log
    comfy_log = comfy["log"].read_text()
    assert comfy_log.count("waiting up to") == 1 and "Retrying" not in comfy_log
    seen = json.loads((comfy["base"] / "comfyui.json").read_text())["models_seen"]
    assert seen == {"url": gmlx_url, "models": embedded}

    # Ctrl-C stops ComfyUI, and ComfyUI stops the server it started.
    comfy["proc"].send_signal(signal.SIGINT)
    comfy["proc"].wait(60)
    deadline = time.monotonic() + 30
    while _answers(gmlx_url) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _answers(gmlx_url)


# ---------------------------------------------------------------- the pack's model and VAE

PACK_PROMPT = "a paper boat on a pond"
LORA_FORM_STRENGTH = 0.7
# vae/decode of two 768² images: one takes several seconds on the tiny model on a CPU (a 512²
# one can end within a second on an idle machine, before the interrupt is sent).
VAE_INTERRUPT_SIZE = 768
VAE_LINE = re.compile(r"POST \S*/vae/decode (\d{3}) ([0-9.]+) ms")
LEAK_WORDS = ("Potential memory leak detected with model", "memory leak with model")


def _loaders(model: str, start_server: bool = True) -> dict:
    inputs = {"model_name": model, "server_url": "", "start_server": start_server}
    return {
        "1": {"class_type": "GmlxModelLoader", "inputs": dict(inputs)},
        "2": {"class_type": "GmlxCLIPLoader", "inputs": dict(inputs)},
        "3": {"class_type": "GmlxVAELoader", "inputs": dict(inputs)},
    }


def _pack_prompt(model: str, seed: int, steps: int = 4, start_server: bool = True) -> dict:
    """Loaders, gmlx Empty Latent (SIZE²), stock KSampler (euler, simple, cfg 1), SaveLatent,
    stock VAEDecode and SaveImage."""
    return {
        **_loaders(model, start_server),
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": PACK_PROMPT}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": ""}},
        "6": {
            "class_type": "GmlxEmptyLatent",
            "inputs": {"vae": ["3", 0], "width": SIZE, "height": SIZE, "batch_size": 1},
        },
        "11": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["1", 0],
                "positive": ["4", 0],
                "negative": ["5", 0],
                "latent_image": ["6", 0],
                "seed": seed,
                "steps": steps,
                "cfg": 1.0,
                "sampler_name": "euler",
                "scheduler": "simple",
                "denoise": 1.0,
            },
        },
        "12": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["3", 0]}},
        "13": {
            "class_type": "SaveImage",
            "inputs": {"images": ["12", 0], "filename_prefix": "e2e/pack"},
        },
        "90": {
            "class_type": "SaveLatent",
            "inputs": {"samples": ["11", 0], "filename_prefix": "latents/pack"},
        },
    }


def _with_lora(wf: dict, name: str, node: str = "LoraLoaderModelOnly") -> dict:
    inputs = {"model": ["1", 0], "lora_name": name, "strength_model": LORA_FORM_STRENGTH}
    if node == "LoraLoader":
        inputs.update(clip=["2", 0], strength_clip=1.0)
    wf["30"] = {"class_type": node, "inputs": inputs}
    wf["11"]["inputs"]["model"] = ["30", 0]
    return wf


def _failure(comfy: dict, workflow: dict) -> str:
    """The exception message of a prompt that must fail."""
    entry = _wait_done(comfy, _queue(comfy, workflow))
    assert entry["status"]["status_str"] == "error", json.dumps(entry["status"])[-2000:]
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    return errors[0]["exception_message"]


# Prints, a JSON line each, the node texts (ComfyUI's binary TEXT event: node id, then text)
# that ComfyUI's websocket sends, until it is killed; run in ComfyUI's Python (it has aiohttp).
_NODE_TEXT_LISTENER = """
import asyncio, json, struct, sys
import aiohttp

async def listen(url):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url + "/ws?clientId=gmlx-node-texts") as ws:
            print("ready", flush=True)
            async for message in ws:
                if message.type != aiohttp.WSMsgType.BINARY:
                    continue
                event, size = struct.unpack(">II", message.data[:8])
                if event == 3:
                    node = message.data[8 : 8 + size].decode()
                    text = message.data[8 + size :].decode()
                    print(json.dumps([node, text]), flush=True)

asyncio.run(listen(sys.argv[1]))
"""


class _NodeTexts:
    """The texts ComfyUI showed on nodes while the block ran: [(node id, text)]."""

    def __init__(self, comfy: dict):
        self.url = comfy["url"]

    def __enter__(self):
        command = [os.environ["COMFYUI_PYTHON"], "-c", _NODE_TEXT_LISTENER, self.url]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)  # the last messages in flight
        self.process.kill()
        lines = self.process.stdout.read().splitlines()
        self.texts = [tuple(json.loads(line)) for line in lines if line]


class _LogSlice:
    """What a log file gained while the block ran."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.start = self.path.stat().st_size
        return self

    def __exit__(self, *exc):
        with open(self.path, "rb") as log:
            log.seek(self.start)
            self.text = log.read().decode("utf-8", "replace")


# Z-Image's layers a LoRA patches: its ComfyUI class maps the diffusers names of the attention
# projections onto a fused qkv weight (which the pack's model lacks); refiners and blocks both.
Z_IMAGE_LORA_LAYERS = (
    "layers.0.attention.to_q",
    "layers.0.attention.to_v",
    "layers.0.feed_forward.w1",
    "noise_refiner.0.attention.to_k",
    "context_refiner.0.attention.to_out.0",
)


def _lora_files(engine, folder: Path, layers=None) -> dict[str, Path]:
    """One random LoRA in every key form the server's `--adapter` loader reads (tests/lora/forms.py
    writes the diffusers, kohya and ComfyUI forms; PEFT's comes with its adapter_config.json, at
    lora_alpha = r so that its scale is ComfyUI's 1; bare names; `model.diffusion_model.`), on
    `layers` (default: forms.py's Qwen-Image layers)."""
    from safetensors.numpy import save_file

    from tests.lora.forms import LAYERS, random_lora, write_form

    layers = layers or LAYERS
    shapes = {t["name"][: -len(".weight")]: t["shape"] for t in engine.manifest()["tensors"]}
    lora = random_lora(shapes, seed=3, rank=2, alpha=1.0, layers=layers)
    bare = random_lora(shapes, seed=3, rank=2, alpha=None, layers=layers)
    diffusers = write_form(bare, "diffusers")
    states = {
        "diffusers": diffusers,
        "kohya": write_form(lora, "kohya"),
        "comfy": write_form(lora, "comfy"),
        "peft": {
            k.replace("transformer.", "base_model.model.", 1): v for k, v in diffusers.items()
        },
        "bare": {k.removeprefix("transformer."): v for k, v in diffusers.items()},
        "model": {"model." + k: v for k, v in write_form(lora, "comfy").items()},
    }
    paths = {}
    for form, state in states.items():
        (folder / form).mkdir(parents=True, exist_ok=True)
        paths[form] = (
            folder / form / ("adapter_model.safetensors" if form == "peft" else "lora.safetensors")
        )
        save_file(state, paths[form])
    (folder / "peft" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    return paths


def _server_table(engine, path: Path):
    """The table the server's own loader (`gmlx image sample --adapter`) builds from the file."""
    from types import SimpleNamespace

    from gmlx_server.config import parse_adapter
    from gmlx_server.lora_files import adapter_table

    loaded = SimpleNamespace(model_id=engine.model_id, model=engine)
    return adapter_table(loaded, [parse_adapter(f"{path}:{LORA_FORM_STRENGTH}")])


@pytest.mark.parametrize("form", ["diffusers", "kohya", "comfy", "peft", "bare", "model"])
def test_lora_in_every_key_form_applies_as_the_server_loader_does(
    comfyui, gmlx_server, engine, form
):
    """LoraLoaderModelOnly with the same LoRA in each form: every key loads, and the latents are
    the engine's under the table `--adapter` builds from the same file."""
    seed, steps = 6, 4
    path = _lora_files(engine, comfyui["base"] / "models" / "loras")[form]
    name = str(path.relative_to(comfyui["base"] / "models" / "loras"))
    wf = _with_lora(_pack_prompt(gmlx_server["model"], seed, steps), name)
    with _LogSlice(comfyui["log"]) as log:
        got = _latent(comfyui, _run(comfyui, wf))
    assert "lora key not loaded" not in log.text and "NOT LOADED" not in log.text, log.text
    sigmas = comfy_simple_sigmas(steps)
    want = direct_sample(engine, PACK_PROMPT, seed, sigmas, _server_table(engine, path))
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, direct_sample(engine, PACK_PROMPT, seed, sigmas)) > 1000 * LATENT_RTOL


# ---------------------------------------------------------------- a run lost mid-sampling


class _RunLosingProxy:
    """An HTTP proxy to the gmlx server that ends the sampling's run on the server just before
    forwarding its second step, as a server restart (or the idle sweep) loses it; it counts
    the runs begun through it."""

    def __init__(self, target: str) -> None:
        import http.server
        import threading

        import requests
        from gmlx_contract.client import StepClient

        from tests.contract.stepserver import send_answer

        self.target, self.begun, self.steps = target, [], 0
        session, proxy = requests.Session(), self

        class Forward(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "POST" and self.path.endswith("/step"):
                    proxy.steps += 1
                    if proxy.steps == 2:
                        StepClient(target).end_run(proxy.begun[-1])
                skip = {"host", "content-length", "connection"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                answer = session.request(
                    self.command, target + self.path, headers=headers, data=body, timeout=600
                )
                if self.path.endswith("/runs/begin") and answer.ok:
                    proxy.begun.append(answer.json()["run"])
                hop = ("content-length", "connection", "transfer-encoding")
                kept = {k: v for k, v in answer.headers.items() if k.lower() not in hop}
                send_answer(self, answer.status_code, kept, answer.content)

            do_GET = do_POST = do_PUT = do_HEAD = _forward

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_run_the_server_lost_mid_sampling_is_begun_again_and_the_image_is_the_same(
    comfyui, gmlx_server
):
    """The server forgets the sampling's run between two steps (a restart, or the idle sweep):
    the pack's next step is answered 404, so it begins a new run and sends the step again, and
    the sampling ends as it would have, latent for latent."""
    wf = _save_latent(_workflow("gmlx_text_to_image"), "11")
    wf["8"]["inputs"]["noise_seed"] = 11
    want = _latent(comfyui, _run(comfyui, wf))
    proxy = _RunLosingProxy(gmlx_server["url"])
    try:
        with _LogSlice(comfyui["log"]) as log:
            got = _latent(comfyui, _run(comfyui, _on_server(wf, proxy.url)))
    finally:
        proxy.close()
    assert proxy.steps >= 3 and len(proxy.begun) == 2, (proxy.steps, proxy.begun)
    assert f"the server no longer knows run {proxy.begun[0]}" in log.text, log.text
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- a rewritten prompt


def test_a_rewritten_prompt_steps_as_its_rewrite_and_a_negative_as_typed(
    comfyui, tmp_path_factory, monkeypatch
):
    """With prompt upsampling on, the server rewrites every prompt the CLIP encodes and also
    answers the prompt as typed (`cond_typed`); the pack steps the positive on the rewrite and
    the negative on the prompt as typed (docs/contract.md §7.4), as the FLUX.3 pipelines never
    rewrite a negative. Served in this process, its steps' rows recorded."""
    from gmlx_server.config import ServerConfig
    from gmlx_server.engine import upsampling
    from gmlx_server.routes import step as step_route

    from tests.server.conftest import serve
    from tests.server.test_prompt_upsampling import (
        NEW_TOKENS,
        encode,
        upsampling_registry,
        write_upsampler,
    )

    folder, _, _ = write_upsampler(tmp_path_factory.mktemp("upsampler"))
    registry = upsampling_registry(tmp_path_factory.mktemp("embedded"), folder, rewrites=True)
    model = registry.default_model
    monkeypatch.setattr(upsampling, "MAX_NEW_TOKENS", NEW_TOKENS)
    stepped, build_row = [], step_route.build_row
    monkeypatch.setattr(
        step_route, "build_row", lambda *args: stepped.append(args[2].cond) or build_row(*args)
    )
    server = serve(ServerConfig(host="127.0.0.1", port=0), registry)
    try:
        wf = _on_server(_workflow("gmlx_flux3_klein_text_to_image"), server.base)
        for loader in ("1", "2", "3"):
            wf[loader]["inputs"].update(model_name=model, start_server=False)
        wf["5"]["inputs"]["text"] = "a blurry picture"
        wf["11"]["inputs"].update(cfg=2.0, steps=2)
        _run(comfyui, wf)
        positive = encode(server, model, text=wf["4"]["inputs"]["text"]).fields
        negative = encode(server, model, text="a blurry picture").fields
    finally:
        server.close()
    assert positive["cond"] != positive["cond_typed"] and negative["cond"] != negative["cond_typed"]
    assert set(stepped) == {positive["cond"], negative["cond_typed"]}, stepped


# ---------------------------------------------------------------- a quantized model


def _on_server(wf: dict, url: str) -> dict:
    """The workflow's gmlx loaders pointed at the server at `url`."""
    for node in wf.values():
        if node["class_type"] in ("GmlxModelLoader", "GmlxCLIPLoader", "GmlxVAELoader"):
            node["inputs"]["server_url"] = url
    return wf


def test_the_quantized_text_to_image_equals_gmlx_image_sample_quantize_4(
    comfyui, quantized_server, quantized_engine, engine, workdir
):
    """The text-to-image example (gmlx Sigmas: the turbo's own sigmas) on the server at
    `--quantize 4` against `gmlx image sample --quantize 4` at the same seed."""
    seed = 7
    wf = _on_server(_save_latent(_workflow("gmlx_text_to_image"), "11"), quantized_server["url"])
    wf["8"]["inputs"]["noise_seed"] = seed
    prompt = wf["4"]["inputs"]["text"]
    entry = _run(comfyui, wf)
    got = _latent(comfyui, entry)
    want = direct_generate(quantized_engine, prompt, seed)
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, direct_generate(engine, prompt, seed)) > 100 * LATENT_RTOL  # 4 bits show

    out = workdir / "direct-q4.png"
    subprocess.run(
        [sys.executable, "-m", "gmlx_server", "image", "sample"]
        + ["--config", str(quantized_server["config"]), "--prompt", prompt]
        + ["--width", str(SIZE), "--height", str(SIZE), "--cfg", "1", "--seed", str(seed)]
        + ["--quantize", str(QUANTIZE_BITS), "--out", str(out)],
        check=True,
    )
    (image,) = _output_files(comfyui, entry, "images")
    assert np.abs(_rgb(image) - _rgb(out)).max() <= PIXEL_TOLERANCE


def test_a_loader_naming_another_server_picks_from_that_servers_models(comfyui, quantized_server):
    """The loaders' list is the list of the server the pack found; a loader whose server_url
    names another server may name a model that server alone has (ComfyUI's list check gives
    way to the loader's own), and one naming none is still refused before the prompt runs."""
    wf = _on_server(_pack_prompt(ELSEWHERE_MODEL, seed=3, steps=2), quantized_server["url"])
    latent = _latent(comfyui, _run(comfyui, wf))
    assert latent.shape == (1, 16, SIZE // 8, SIZE // 8) and np.isfinite(latent).all()
    with pytest.raises(AssertionError, match="400 .*name the server that has it"):
        _queue(comfyui, _pack_prompt(ELSEWHERE_MODEL, seed=3, steps=2))


def test_stock_ksampler_on_the_quantized_model_equals_the_in_process_sampler(
    comfyui, quantized_server, quantized_engine, engine
):
    """The stock KSampler (euler, "simple") on the server at `--quantize 4`, against the
    engine at the same precision from the same seed along the same sigmas."""
    seed, steps = 12, 4
    wf = _on_server(_pack_prompt(quantized_server["model"], seed, steps), quantized_server["url"])
    got = _latent(comfyui, _run(comfyui, wf))
    sigmas = comfy_simple_sigmas(steps)
    want = direct_sample(quantized_engine, PACK_PROMPT, seed, sigmas)
    assert _rel(got, want) <= LATENT_RTOL
    assert _rel(want, direct_sample(engine, PACK_PROMPT, seed, sigmas)) > 100 * LATENT_RTOL


def test_a_lora_on_the_quantized_model_applies_as_the_server_loader_does(
    comfyui, quantized_server, quantized_engine
):
    """LoraLoaderModelOnly with the ComfyUI-form LoRA on the quantized model: every key loads
    (the manifest keeps the logical shapes), and the pairs apply in float beside the 4-bit
    weights as the table `--adapter` builds from the file does."""
    seed, steps = 6, 4
    path = _lora_files(quantized_engine, comfyui["base"] / "models" / "loras" / "q4")["comfy"]
    name = str(path.relative_to(comfyui["base"] / "models" / "loras"))
    wf = _with_lora(_pack_prompt(quantized_server["model"], seed, steps), name)
    wf = _on_server(wf, quantized_server["url"])
    with _LogSlice(comfyui["log"]) as log:
        got = _latent(comfyui, _run(comfyui, wf))
    assert "lora key not loaded" not in log.text and "NOT LOADED" not in log.text, log.text
    sigmas = comfy_simple_sigmas(steps)
    table = _server_table(quantized_engine, path)
    want = direct_sample(quantized_engine, PACK_PROMPT, seed, sigmas, table)
    assert _rel(got, want) <= LATENT_RTOL
    plain = direct_sample(quantized_engine, PACK_PROMPT, seed, sigmas)
    assert _rel(want, plain) > 1000 * LATENT_RTOL


# Krea 2's: q and the gate (fused here), k and v (fused), the text fusion, an MLP's down.
KREA2_LORA_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_gate",
    "transformer_blocks.1.attn.to_v",
    "transformer_blocks.1.ff.down",
    "text_fusion.refiner_blocks.0.attn.to_k",
)
# FLUX.3 klein's: q and k of a joint block (fused here), the image mode's MLP input, the text
# mode's v.
FLUX3_LORA_LAYERS = (
    "single_transformer_blocks.0.attn.to_q",
    "single_transformer_blocks.0.attn.to_k",
    "mode_blocks.image.0.ff.linear_in",
    "txt_mode_blocks.0.attn.to_v",
)
FORMS_ON = [
    (Z_IMAGE_MODEL, Z_IMAGE_LORA_LAYERS, form)
    for form in ("diffusers", "kohya", "comfy", "peft", "bare", "model")
] + [
    (model, layers, form)
    for model, layers in ((KREA2_MODEL, KREA2_LORA_LAYERS), (FLUX3_KLEIN_MODEL, FLUX3_LORA_LAYERS))
    for form in ("diffusers", "kohya", "comfy", "peft")
]


@pytest.mark.parametrize(("model", "layers", "form"), FORMS_ON)
def test_a_pack_built_models_lora_in_every_key_form_applies_as_the_server_loader_does(
    comfyui, gmlx_server, model, layers, form
):
    """As above on Z-Image, whose ComfyUI class (0.33) maps the diffusers forms onto its own
    fused qkv names (the pack's keys take their place, so every key still loads), and on
    Krea 2 and FLUX.3 klein (a flow map), which no ComfyUI knows."""
    seed, steps = 6, 4
    engine = _served_engine(gmlx_server["config"], model)
    folder = comfyui["base"] / "models" / "loras" / model
    path = _lora_files(engine, folder, layers)[form]
    name = str(path.relative_to(comfyui["base"] / "models" / "loras"))
    wf = _with_lora(_pack_prompt(model, seed, steps), name)
    with _LogSlice(comfyui["log"]) as log:
        got = _latent(comfyui, _run(comfyui, wf))
    assert "lora key not loaded" not in log.text and "NOT LOADED" not in log.text, log.text
    sigmas = comfy_simple_sigmas(steps, engine.status()["sampling"]["shift"])
    table = _server_table(engine, path)
    want = direct_sample(engine, PACK_PROMPT, seed, sigmas, table)
    moved = _rel(want, direct_sample(engine, PACK_PROMPT, seed, sigmas))
    print(f"{model} LoRA ({form}): rel L2 {_rel(got, want):.1e}, the LoRA moves it {moved:.1%}")
    assert _rel(got, want) <= LATENT_RTOL
    assert moved > 100 * LATENT_RTOL


# FLUX.2 klein's layers a LoRA patches, by BFL's names (ComfyUI's own Flux2 weights: fused q/k/v
# per stream, linear1, the final modulation stored with its halves swapped) and by diffusers'
# (which ComfyUI's Flux class maps onto those BFL weights, norm_out.linear through a function).
FLUX2_BFL_LORA_LAYERS = (
    "double_blocks.0.img_attn.qkv",
    "double_blocks.1.txt_attn.qkv",
    "double_blocks.0.img_mlp.0",
    "single_blocks.0.linear1",
    "double_stream_modulation_img.lin",
    "final_layer.adaLN_modulation.1",
)
FLUX2_DIFFUSERS_LORA_LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.1.attn.add_v_proj",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    "norm_out.linear",
)


def _flux2_bfl_lora_files(engine, folder: Path) -> dict[str, Path]:
    """One random LoRA on BFL's names in the forms found in the wild: ai-toolkit's
    (`diffusion_model.<name>.lora_A/.lora_B`, no alpha), ComfyUI's (`.lora_down/.lora_up/.alpha`)
    and kohya's (`lora_unet_<name with _ for .>`)."""
    from gmlx_contract.lora_keys import layer_aliases
    from safetensors.numpy import save_file

    from tests.lora.forms import random_lora

    manifest = engine.manifest()
    columns = {t["name"][: -len(".weight")]: t["shape"][-1] for t in manifest["tensors"]}
    shapes = {
        alias: (sum(p.length for p in pieces), columns[pieces[0].layer])
        for alias, pieces in layer_aliases(manifest).items()
    }
    lora = random_lora(shapes, seed=5, rank=2, alpha=1.0, layers=FLUX2_BFL_LORA_LAYERS)
    stems = {
        "bfl-ai-toolkit": lambda name: f"diffusion_model.{name}",
        "bfl-comfy": lambda name: f"diffusion_model.{name}",
        "bfl-kohya": lambda name: "lora_unet_" + name.replace(".", "_"),
    }
    paths = {}
    for form, stem_of in stems.items():
        state = {}
        for name, (a, b) in lora.pairs.items():
            stem = stem_of(name)
            if form == "bfl-ai-toolkit":
                state[f"{stem}.lora_A.weight"], state[f"{stem}.lora_B.weight"] = a, b
                continue
            state[f"{stem}.lora_down.weight"], state[f"{stem}.lora_up.weight"] = a, b
            state[f"{stem}.alpha"] = np.array(lora.alpha, np.float32)
        paths[form] = folder / form / "lora.safetensors"
        paths[form].parent.mkdir(parents=True, exist_ok=True)
        save_file(state, paths[form])
    return paths


@pytest.mark.parametrize("form", ["bfl-ai-toolkit", "bfl-comfy", "bfl-kohya", "diffusers", "comfy"])
def test_a_flux2_klein_lora_in_bfl_and_diffusers_names_applies_as_the_server_loader_does(
    comfyui, gmlx_server, flux2_engine, form
):
    """LoraLoaderModelOnly on FLUX.2 klein with a LoRA keyed by BFL's names (ComfyUI's Flux2
    weights) or by diffusers' (ComfyUI's Flux class maps those onto the BFL weights): every key
    loads, and the latents are the engine's under the table `--adapter` builds from the file."""
    seed, steps = 6, 3
    folder = comfyui["base"] / "models" / "loras" / "flux2"
    if form.startswith("bfl-"):
        path = _flux2_bfl_lora_files(flux2_engine, folder)[form]
    else:
        path = _lora_files(flux2_engine, folder, FLUX2_DIFFUSERS_LORA_LAYERS)[form]
    name = str(path.relative_to(comfyui["base"] / "models" / "loras"))
    wf = _with_lora(_save_latent(_pack_prompt(FLUX2_MODEL, seed, steps), "11"), name)
    with _LogSlice(comfyui["log"]) as log:
        got = _latent(comfyui, _run(comfyui, wf))
    assert "lora key not loaded" not in log.text and "NOT LOADED" not in log.text, log.text
    sigmas = comfy_simple_sigmas(steps, flux2_engine.status()["sampling"]["shift"])
    table = _server_table(flux2_engine, path)
    want = flux2_sample(flux2_engine, PACK_PROMPT, seed, sigmas, table=table)
    moved = _rel(want, flux2_sample(flux2_engine, PACK_PROMPT, seed, sigmas))
    print(
        f"FLUX.2 klein LoRA ({form}): rel L2 {_rel(got, want):.1e}, the LoRA moves it {moved:.1%}"
    )
    assert _rel(got, want) <= LATENT_RTOL
    assert moved > 100 * LATENT_RTOL


def test_lora_loader_with_clip_reads_the_diffusers_form(comfyui, gmlx_server, engine):
    seed, steps = 6, 4
    path = _lora_files(engine, comfyui["base"] / "models" / "loras")["diffusers"]
    wf = _with_lora(
        _pack_prompt(gmlx_server["model"], seed, steps), "diffusers/lora.safetensors", "LoraLoader"
    )
    got = _latent(comfyui, _run(comfyui, wf))
    want = direct_sample(
        engine, PACK_PROMPT, seed, comfy_simple_sigmas(steps), _server_table(engine, path)
    )
    assert _rel(got, want) <= LATENT_RTOL


def test_a_lora_that_maps_onto_nothing_is_an_error_naming_the_file(comfyui, gmlx_server):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    stem = "transformer.transformer_blocks.99.attn.to_q"  # a block past the last
    state = {
        f"{stem}.lora_A.weight": rng.standard_normal((2, 8)).astype(np.float32),
        f"{stem}.lora_B.weight": rng.standard_normal((8, 2)).astype(np.float32),
    }
    save_file(state, comfyui["base"] / "models" / "loras" / "other_model.safetensors")
    wf = _with_lora(_pack_prompt(gmlx_server["model"], 1, 1), "other_model.safetensors")
    message = _failure(comfyui, wf)
    assert "'other_model.safetensors'" in message and "changes nothing" in message


def test_a_half_matching_lora_applies_what_lands_and_says_what_is_left_out(
    comfyui, gmlx_server, engine
):
    """A LoRA of one layer of the model and one it lacks: ComfyUI applies the first (the
    latents are the engine's under that layer alone) and the pack's warning names the file and
    the layer left out, in ComfyUI's log and on the LoRA node."""
    from safetensors.numpy import save_file

    seed, steps = 6, 2
    layer = "transformer_blocks.0.attn.to_q"
    out_dim, in_dim = next(
        t["shape"] for t in engine.manifest()["tensors"] if t["name"] == layer + ".weight"
    )
    rng = np.random.default_rng(0)
    state = {}
    for block in (0, 99):  # 99: a block past the last
        stem = f"transformer.transformer_blocks.{block}.attn.to_q"
        state[f"{stem}.lora_A.weight"] = rng.standard_normal((2, in_dim)).astype(np.float32)
        state[f"{stem}.lora_B.weight"] = rng.standard_normal((out_dim, 2)).astype(np.float32)
    loras = comfyui["base"] / "models" / "loras"
    save_file(state, loras / "half.safetensors")
    fits = {k: v for k, v in state.items() if ".99." not in k}
    save_file(fits, loras / "half_fitting_part.safetensors")
    wf = _with_lora(_pack_prompt(gmlx_server["model"], seed, steps), "half.safetensors")
    with _LogSlice(comfyui["log"]) as log, _NodeTexts(comfyui) as shown:
        got = _latent(comfyui, _run(comfyui, wf))
    warning = "gmlx: the LoRA file 'half.safetensors' patches 1 of its 2 layers"
    assert warning in log.text and "transformer_blocks.99.attn.to_q" in log.text, log.text
    assert [text for node, text in shown.texts if node == "30" and warning in text], shown.texts
    table = _server_table(engine, loras / "half_fitting_part.safetensors")
    want = direct_sample(engine, PACK_PROMPT, seed, comfy_simple_sigmas(steps), table)
    assert _rel(got, want) <= LATENT_RTOL


def test_a_lora_of_the_wrong_shape_is_refused_at_its_loader_naming_the_file(comfyui, gmlx_server):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    stem = "transformer.transformer_blocks.0.attn.to_q"  # a layer of the model, other widths
    state = {
        f"{stem}.lora_A.weight": rng.standard_normal((2, 7)).astype(np.float32),
        f"{stem}.lora_B.weight": rng.standard_normal((5, 2)).astype(np.float32),
    }
    save_file(state, comfyui["base"] / "models" / "loras" / "wrong_shape.safetensors")
    wf = _with_lora(_pack_prompt(gmlx_server["model"], 1, 1), "wrong_shape.safetensors")
    entry = _wait_done(comfyui, _queue(comfyui, wf))
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors and errors[0]["node_type"] == "LoraLoaderModelOnly", errors
    message = errors[0]["exception_message"]
    assert "'wrong_shape.safetensors' does not fit" in message and "attn.to_q" in message


def _stock_latent_carries_its_stride() -> bool:
    """Whether this ComfyUI's empty latents say their stride (`downscale_ratio_spacial`)."""
    sample = Path(os.environ["COMFYUI_DIR"]) / "comfy" / "sample.py"
    return "downscale_ratio_spacial" in sample.read_text()


@pytest.mark.parametrize("node", ["EmptyLatentImage", "EmptySD3LatentImage"])
def test_stock_empty_latents_give_the_size_asked_for_or_name_the_node(comfyui, gmlx_server, node):
    seed = 8
    wf = _pack_prompt(gmlx_server["model"], seed, steps=2)
    wf["6"] = {"class_type": node, "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}}
    if not _stock_latent_carries_its_stride():  # ComfyUI 0.3.64
        assert "gmlx Empty Latent" in _failure(comfyui, wf)
        return
    entry = _run(comfyui, wf)
    (image,) = _output_files(comfyui, entry, "images")
    assert _rgb(image).shape == (SIZE, SIZE, 3)
    gmlx_latent = _latent(comfyui, _run(comfyui, _pack_prompt(gmlx_server["model"], seed, 2)))
    assert np.array_equal(_latent(comfyui, entry), gmlx_latent)


def test_gmlx_empty_latent_says_when_it_rounds(comfyui, gmlx_server):
    wf = _pack_prompt(gmlx_server["model"], 2, steps=1)
    wf["6"]["inputs"].update(width=SIZE + 8, height=SIZE // 2 + 7)
    with _LogSlice(comfyui["log"]) as log:
        entry = _run(comfyui, wf)
    (note,) = entry["outputs"]["6"]["text"]
    assert f"rounded down to {SIZE}×{SIZE // 2}" in note and note in log.text
    (image,) = _output_files(comfyui, entry, "images")
    assert _rgb(image).shape == (SIZE // 2, SIZE, 3)


def test_images_are_rgb_and_alpha_comes_as_a_mask(comfyui, gmlx_server, engine):
    """Stock VAEDecode + SaveImage writes RGB; gmlx VAE Decode gives the same RGB and
    mask = 1 - alpha (LoadImage's convention), checked against the engine's own decode."""
    from PIL import Image

    wf = _pack_prompt(gmlx_server["model"], 9, steps=2)
    wf["14"] = {"class_type": "GmlxVAEDecode", "inputs": {"samples": ["11", 0], "vae": ["3", 0]}}
    wf["15"] = {"class_type": "MaskToImage", "inputs": {"mask": ["14", 1]}}
    for node, source, prefix in (("16", "14", "e2e/rgb"), ("17", "15", "e2e/mask")):
        wf[node] = {
            "class_type": "SaveImage",
            "inputs": {"images": [source, 0], "filename_prefix": prefix},
        }
    entry = _run(comfyui, wf)
    stock, rgb, mask = (
        _output_files(comfyui, {"outputs": {n: entry["outputs"][n]}}, "images")[0]
        for n in ("13", "16", "17")
    )
    assert Image.open(stock).mode == "RGB" and Image.open(rgb).mode == "RGB"
    assert np.array_equal(_rgb(stock), _rgb(rgb))
    alpha = engine.vae_decode(_latent(comfyui, entry)[0], True)[..., 3]
    assert np.abs(alpha - (1.0 - alpha)).mean() > 0.05  # the test tells alpha from 1 - alpha
    got = _rgb(mask)[..., 0] / 255.0
    assert np.abs(got - (1.0 - alpha)).max() <= 1.0 / 255.0 + 1e-6


def _decodes_logged(log: Path) -> list[float]:
    return [float(m[2]) for m in VAE_LINE.finditer(log.read_text())]


def test_vae_decode_stops_at_an_interrupt(comfyui, gmlx_server):
    """Interrupted in the first of two 768² decodes: ComfyUI reports it at once, and the second
    image is never sent (the server finishes the one in flight)."""
    side = VAE_INTERRUPT_SIZE
    wf = {
        **_loaders(gmlx_server["model"]),
        "6": {
            "class_type": "GmlxEmptyLatent",
            "inputs": {"vae": ["3", 0], "width": side, "height": side + 16, "batch_size": 2},
        },
        "12": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["3", 0]}},
        "13": {"class_type": "PreviewImage", "inputs": {"images": ["12", 0]}},
    }
    before = len(_decodes_logged(gmlx_server["log"]))
    prompt_id = _queue(comfyui, wf)
    deadline = time.monotonic() + PROMPT_TIMEOUT_S
    while not _json(comfyui["url"] + "/queue")["queue_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)  # the loaders and the latent take milliseconds: a decode is in flight
    assert len(_decodes_logged(gmlx_server["log"])) == before
    latency_ms = _interrupt_reported_ms(comfyui, prompt_id)
    assert latency_ms < 500.0, latency_ms

    while len(_decodes_logged(gmlx_server["log"])) == before:  # the image in flight ends
        assert time.monotonic() < deadline
        time.sleep(0.2)
    decode_ms = _decodes_logged(gmlx_server["log"])[-1]
    assert decode_ms > 2000.0  # it really was in flight when the interrupt came
    time.sleep(1.5 * decode_ms / 1000.0)
    assert len(_decodes_logged(gmlx_server["log"])) == before + 1  # the second never went
    _run(comfyui, _pack_prompt(gmlx_server["model"], 1, steps=1))


def test_rerunning_the_loaders_frees_the_old_model(comfyui, gmlx_server):
    """Three prompts whose loaders run afresh each time (their inputs change): ComfyUI's model
    management finds no model outliving its patcher (comfy.model_management.cleanup_models_gc
    logs that as a potential memory leak)."""
    with _LogSlice(comfyui["log"]) as log:
        for start_server in (True, False, True):
            _run(comfyui, _pack_prompt(gmlx_server["model"], 1, 1, start_server=start_server))
    assert not [word for word in LEAK_WORDS if word in log.text], log.text[-3000:]


# ---------------------------------------------------------------- the frontend (browser)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM:
        pytest.skip("CHROMIUM (a Chromium binary for the browser check) is not set")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _open_frontend(browser, comfy: dict):
    """The frontend with its first-run template browser already seen (a fresh user's first
    visit opens it by itself; the test opens it as a user does later)."""
    seen = urllib.request.Request(
        comfy["url"] + "/settings/Comfy.TutorialCompleted", data=b"true", method="POST"
    )
    urllib.request.urlopen(seen, timeout=30).close()
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(comfy["url"])
    page.wait_for_function("window.app?.graph && window.app.extensionManager", timeout=120_000)
    return page


def _find_pack_templates(page, link_name: str) -> None:
    """In the open template browser, the pack's templates as docs/comfyui.md says: the pack's
    own entry under Extensions where the frontend has one (1.3x, ComfyUI 0.8: cards found by a
    search there keep their placeholders and never fetch their thumbnails), else a search."""
    search = page.get_by_placeholder(re.compile("^Search"))
    search.wait_for()  # the dialog, its sidebar with it
    extension = page.get_by_text(link_name, exact=True)
    if extension.count():
        extension.first.click()
    else:
        search.fill("gmlx")


def _command(page, command: str) -> None:
    """Run a frontend command (what its menus and buttons call)."""
    page.evaluate("command => app.extensionManager.command.execute(command)", command)


def _frontend_prompt(page) -> dict:
    """The prompt the frontend would queue for its open workflow, as the API copies hold it."""
    output = json.loads(
        page.evaluate("async () => JSON.stringify((await app.graphToPrompt()).output)")
    )
    return {
        key: {"class_type": n["class_type"], "inputs": n["inputs"]} for key, n in output.items()
    }


def _pick_model(page, model: str) -> None:
    """Every loader's model_name widget set to `model` on the open graph."""
    page.evaluate(
        """model => { for (const node of app.graph.nodes) {
            const widget = (node.widgets || []).find(w => w.name === "model_name");
            if (widget) widget.value = model;
        } }""",
        model,
    )


@pytest.mark.parametrize("name", NAMES)
def test_example_opens_from_the_template_browser_and_runs(comfyui, browser, name):
    """Templates → search "gmlx" → click the example: the frontend fetches its thumbnail (the .jpg
    beside the UI file) and loads the UI file (its graph is the API copy); queuing it from the
    frontend runs it to the end on a fresh install."""
    from gmlx_comfy.install import LINK_NAME

    page = _open_frontend(browser, comfyui)
    thumbnail = f"/workflow_templates/{LINK_NAME}/{name}.jpg"
    fetched = []
    page.on("response", lambda r: fetched.append(r.status) if r.url.endswith(thumbnail) else None)
    try:
        _command(page, "Comfy.BrowseTemplates")
        _find_pack_templates(page, LINK_NAME)
        card_title = page.get_by_text(name, exact=True).first
        card_title.scroll_into_view_if_needed()
        deadline = time.monotonic() + 30
        while not fetched and time.monotonic() < deadline:
            page.wait_for_timeout(100)
        assert fetched and set(fetched) == {200}, fetched
        card_title.click()
        nodes = len(ui_workflow(name)["nodes"])
        page.wait_for_function(f"app.graph.nodes.length === {nodes}", timeout=30_000)
        assert _frontend_prompt(page) == api_workflow(name)
        if name in FLUX2_KLEIN_NAMES:  # as its note says: pick the klein the server lists
            _pick_model(page, FLUX2_MODEL)

        with page.expect_response(
            lambda r: r.url.endswith("/prompt") and r.request.method == "POST"
        ) as answer:
            _command(page, "Comfy.QueuePrompt")
        assert answer.value.status == 200, answer.value.text()
        entry = _wait_done(comfyui, answer.value.json()["prompt_id"])
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-3000:]
        if SCREENSHOT_DIR:
            page.wait_for_timeout(1000)  # the Save Image preview
            page.screenshot(path=str(Path(SCREENSHOT_DIR) / f"{name}.png"))
    finally:
        page.close()
