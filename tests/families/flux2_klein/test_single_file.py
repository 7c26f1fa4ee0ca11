"""FLUX.2 klein's DiT from BFL's single safetensors file (`flux-2-klein-4b.safetensors`, as
ComfyUI's `diffusion_models` hold it: `double_blocks.N.img_attn.qkv.weight`, ..., optionally
under `model.diffusion_model.` or `diffusion_model.`), in a model folder's transformer/ or
named by a model entry's `dit`, and from a GGUF file named so, through the whole seam over
HTTP: the test's BFL layout is what diffusers' own single-file conversion turns back into the
diffusers state dict exactly; the steps equal diffusers' transformer on the same weights; the
status and manifest keep the family's diffusers names and shapes; a file of the wrong shapes or
missing a tensor is refused 400 naming it, before the resident model is let go."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import (
    convert_flux2_transformer_checkpoint_to_diffusers,
)
from gguf import GGMLQuantizationType as T
from gmlx_contract import wire
from gmlx_server.config import ModelSettings, ServerConfig
from gmlx_server.engine.families.flux2_klein.dit import (
    DiTConfig,
    Flux2DiT,
    dit_file,
    tensor_shapes,
)
from gmlx_server.engine.gguf import GGUFError
from gmlx_server.engine.precision import Quantization
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.weights import gguf_file, read_config, write_quantized
from safetensors.torch import save_file

from tests.compare import rel_l2
from tests.families.flux2_klein.reference import reference_dit
from tests.families.flux2_klein.test_gguf import types_for, write_file
from tests.families.flux2_klein.tiny.bfl import bfl_state_dict
from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.families.flux2_klein.tiny.transformer import build_transformer
from tests.server.conftest import serve

TOLERANCE = 1e-4
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
BFL_FILE = "flux-2-klein-tiny.safetensors"
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def state_of(model) -> dict[str, np.ndarray]:
    return {name: value.detach().numpy() for name, value in model.state_dict().items()}


def save_bfl(path, weights, prefix="", dtype="F32"):
    """BFL's safetensors file of a diffusers state dict (float32 numpy), at `dtype`; returns
    what it holds in float32, by BFL name."""
    tensors = {
        prefix + name: torch.from_numpy(np.ascontiguousarray(value)).to(TORCH_DTYPES[dtype])
        for name, value in bfl_state_dict(weights).items()
    }
    save_file(tensors, str(path))
    return {name[len(prefix) :]: value.float().numpy() for name, value in tensors.items()}


def converted(bfl: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    state = {name: torch.from_numpy(np.array(value)) for name, value in bfl.items()}
    return convert_flux2_transformer_checkpoint_to_diffusers(state)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_single") / "transformer"
    return folder, build_transformer(folder, seed=0)


def test_the_bfl_layout_is_what_diffusers_converts(tiny):
    folder, model = tiny
    weights = state_of(model)
    back = converted(bfl_state_dict(weights))
    assert set(back) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name].numpy(), value, err_msg=name)
    config = DiTConfig.from_dict(read_config(folder))
    assert tensor_shapes(config) == {name: value.shape for name, value in weights.items()}


def inputs(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 128, 3, 4)).astype(np.float32)
    cap = rng.standard_normal((1, 5, 96)).astype(np.float32)
    return x, cap, [rng.standard_normal((128, 2, 2)).astype(np.float32)]


def forward(dit, x, cap, refs):
    refs = [[mx.array(r) for r in refs]]
    t = mx.array([0.7], mx.float32)
    return np.array(dit.forward(mx.array(x), t, [mx.array(cap[0])], refs))


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model.", "diffusion_model."])
@pytest.mark.parametrize("where", ["folder", "entry"])
def test_a_bfl_file_steps_as_diffusers(tiny, tmp_path, where, prefix, dtype):
    """In transformer/, the BFL file alone beside config.json, or named as the entry's `dit`."""
    source, model = tiny
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    path = (folder if where == "folder" else tmp_path) / BFL_FILE
    held = save_bfl(path, state_of(model), prefix, dtype)
    single = dit_file(folder, None if where == "folder" else path)
    assert single is not None and single.path == path
    dit = Flux2DiT.load(folder, mx.float32, dit=None if where == "folder" else path)
    reference = type(model)(**model.config).eval()
    reference.load_state_dict(converted(held))
    x, cap, refs = inputs(1)
    expected = reference_dit(reference, x, [0.7], cap, refs)
    assert rel_l2(forward(dit, x, cap, refs), expected) <= TOLERANCE
    assert dit.weights["double"][0]["norm_q"].dtype == mx.float32  # norm scales in float32
    assert single.status() is None  # float weights, as a folder's


def test_a_diffusers_folder_is_no_single_file(tiny, tmp_path):
    """Diffusers' own folder, and one stored quantized (its packed weights beside float
    ones), load as folders."""
    folder, _ = tiny
    assert dit_file(folder) is None
    stored = tmp_path / "quantized"
    write_quantized(folder, stored, Quantization(8, 32), lambda name: "blocks." in name)
    assert dit_file(stored) is None
    assert Flux2DiT.load(stored, mx.float32).weights["double"][0]["img_qkv"].dtype == mx.uint32


def test_a_float8_checkpoint_is_refused_naming_its_tensor(tiny, tmp_path):
    folder, model = tiny
    path = tmp_path / "flux-2-klein-tiny-fp8.safetensors"
    tensors = {n: torch.from_numpy(v) for n, v in bfl_state_dict(state_of(model)).items()}
    tensors["img_in.weight"] = tensors["img_in.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(path))
    with pytest.raises(GGUFError, match=re.escape(f"{path}: tensor img_in.weight is stored as F8")):
        dit_file(folder, path).open()


def test_the_other_families_read_a_dit_file_as_gguf_only(tmp_path):
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_file(tmp_path, tmp_path / BFL_FILE)


# ---------------------------------------------------------------------------------------------
# Over HTTP

REFERENCE, FOLDER, ENTRY, GGUF = "klein-tiny", "klein-bfl", "klein-entry", "klein-gguf"
WRONG, MISSING = "klein-wrong", "klein-missing"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Model folders: the diffusers one; a copy whose transformer/ holds BFL's file (under
    `model.diffusion_model.`); copies whose entries name BFL's safetensors file, a GGUF file
    (Q8_0 matrices, F32 vectors), one of the wrong shapes and one missing a tensor."""
    root = tmp_path_factory.mktemp("flux2_bfl_seam")
    models, files = root / "models", root / "files"
    files.mkdir()
    transformer = build_tiny_folder(models / REFERENCE, family="flux2_klein")
    weights = state_of(transformer)
    for name in (FOLDER, ENTRY, GGUF, WRONG, MISSING):
        shutil.copytree(models / REFERENCE, models / name)
    (models / FOLDER / "transformer" / WEIGHTS_FILE).unlink()
    save_bfl(models / FOLDER / "transformer" / BFL_FILE, weights, "model.diffusion_model.")
    save_bfl(files / BFL_FILE, weights)
    bfl = bfl_state_dict(weights)
    held = write_file(files / "klein-Q8_0.gguf", bfl, types_for(T.Q8_0, bfl), 8)
    wrong = {n: v[:, :32] if n == "txt_in.weight" else v for n, v in bfl.items()}
    write_file(files / "wrong.gguf", wrong, types_for(T.Q8_0, wrong), 9)
    save_file(
        {n: torch.from_numpy(v) for n, v in bfl.items() if n != "double_blocks.1.img_mlp.0.weight"},
        str(files / "missing.safetensors"),
    )
    config = replace(ServerConfig(host="127.0.0.1", port=0), model_dirs=[models])
    for name, path in (
        (ENTRY, files / BFL_FILE),
        (GGUF, files / "klein-Q8_0.gguf"),
        (WRONG, files / "wrong.gguf"),
        (MISSING, files / "missing.safetensors"),
    ):
        config.models[name] = ModelSettings(dit=path)
    registry = ModelRegistry([models], REFERENCE, settings=config.load_settings_for)
    server = serve(config, registry)
    quantized = type(transformer)(**transformer.config).eval()
    quantized.load_state_dict(converted(held))
    server.references = {REFERENCE: transformer, FOLDER: transformer, ENTRY: transformer}
    server.references[GGUF] = quantized
    server.files = files
    yield server
    server.close()


def manifest(live, model):
    r = live.call("GET", f"models/{model}/manifest")
    assert r.status_code == 200, r.text
    return {key: value for key, value in r.json().items() if key != "model"}


def test_the_manifest_keeps_the_familys_names_and_shapes(live):
    expected = manifest(live, REFERENCE)
    for model in (FOLDER, ENTRY):
        assert manifest(live, model) == expected  # names, shapes and dtypes alike
    quantized = manifest(live, GGUF)
    assert [(t["name"], t["shape"]) for t in quantized["tensors"]] == [
        (t["name"], t["shape"]) for t in expected["tensors"]
    ]
    dtypes = {t["name"]: t["dtype"] for t in quantized["tensors"]}
    assert dtypes["transformer_blocks.0.attn.to_q.weight"] == "quant"
    assert dtypes["norm_out.linear.weight"] == "quant"
    assert dtypes["transformer_blocks.0.attn.norm_q.weight"] == "f32"


@pytest.mark.parametrize("model", [FOLDER, ENTRY, GGUF])
def test_the_step_is_diffusers_on_the_files_weights(live, model):
    unloaded = live.call("GET", f"models/{model}/status").json()
    r = live.post_json("encode", {"model": model, "text": "a red fox"})
    assert r.status_code == 200, r.text
    cond = wire.read_container(r.content).tensors["cond"]
    x = np.random.default_rng(2).standard_normal((1, 128, 3, 5)).astype(np.float32)
    ref = np.random.default_rng(3).standard_normal((128, 2, 4)).astype(np.float32)
    row = {"cond": live.put_tensor(cond), "ref_latents": [live.put_tensor(ref[None])]}
    arrays = {"x": x, "timestep": np.array([0.6], np.float32)}
    r = live.post_container("step", arrays, {"model": model, "rows": [row]})
    assert r.status_code == 200, r.text
    out = wire.read_container(r.content).tensors["out"]
    expected = reference_dit(live.references[model], x, [0.6], cond, [ref])
    assert rel_l2(out, expected) <= TOLERANCE
    loaded = live.call("GET", f"models/{model}/status").json()
    held = ("resident", "residency", "memory")  # what is held changes with the load
    assert {k: v for k, v in loaded.items() if k not in held} == {
        k: v for k, v in unloaded.items() if k not in held
    }
    files = ("dit_bytes", "encoder_bytes", "vae_bytes")
    assert {k: loaded["memory"][k] for k in files} == {k: unloaded["memory"][k] for k in files}
    for name, component in loaded["residency"].items():
        assert component["resident"] and not unloaded["residency"][name]["resident"]
        assert component["bytes"] == unloaded["residency"][name]["bytes"], name
        assert component["quantization"] == unloaded["residency"][name]["quantization"], name
    reference = live.call("GET", f"models/{REFERENCE}/status").json()
    if model == GGUF:  # the file's bytes: Q8_0 holds about a quarter of float32's
        assert loaded["memory"]["dit_bytes"] < reference["memory"]["dit_bytes"] / 2
    else:
        assert loaded["memory"]["dit_bytes"] == reference["memory"]["dit_bytes"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (WRONG, "wrong.gguf: tensor txt_in.weight has shape [64, 32] where FLUX.2 klein's"),
        (
            MISSING,
            "missing.safetensors is not a FLUX.2 klein DiT: it has no tensor"
            " transformer_blocks.1.ff.linear_in.weight",
        ),
    ],
)
def test_a_bad_file_is_refused_before_the_resident_model_goes(live, model, message):
    assert live.post_json("models/load", {"model": FOLDER}).status_code == 200
    r = live.post_json("models/load", {"model": model})
    assert r.status_code == 400
    assert message in r.text, r.text
    assert live.ctx.service.registry.resident_ids() == [FOLDER]
