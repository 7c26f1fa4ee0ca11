"""Hostile weight files: a FLUX.3 klein DiT as a GGUF file (every readable type mixed, as the
conformance suite writes it) and as BFL's single safetensors file, cut short at random points,
bytes flipped anywhere and in the header, named by a model entry's `dit`. Every load either
succeeds (a flipped weight is still a weight) or is refused 400 naming the file, never another
error, and a model loaded beside stays loaded and steps. A VAE or text encoder holding float8,
float64 or integer tensors (a ComfyUI fp8 file, a header relabelled) is refused naming the
tensor before the resident model goes."""

from __future__ import annotations

import json
import random
import shutil
import struct

import numpy as np
import pytest
from gmlx_contract.errors import ContractError
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.load_settings import LoadSettings
from gmlx_server.engine.registry import ModelRegistry
from safetensors.numpy import load_file, save_file

from tests.families.flux3_klein.bfl import bfl_state_dict
from tests.families.flux3_klein.tiny import build_tiny_folder
from tests.families.test_conformance import write_gguf_dit

QUICK, HEAVY = 24, 600  # mutated files per kind: the CI run, the heavy one
HEADER_BYTES = 4096  # where a header mutation lands (names, shapes, types, offsets)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_files")
    plain = build_tiny_folder(root / "models" / "plain")
    shutil.copytree(plain, root / "models" / "hostile")
    write_gguf_dit(plain / "transformer", root / "dit.gguf", root / "dequantized" / "transformer")
    weights = load_file(str(plain / "transformer" / "diffusion_pytorch_model.safetensors"))
    save_file(bfl_state_dict(weights), str(root / "bfl.safetensors"))
    return root


def mutated(good: bytes, rng: random.Random) -> tuple[str, bytes]:
    data = bytearray(good)
    kind = rng.choice(["cut", "flip", "header"])
    if kind == "cut":
        return kind, bytes(data[: rng.randrange(len(data))])
    reach = len(data) if kind == "flip" else min(len(data), HEADER_BYTES)
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(reach)] = rng.randrange(256)
    return kind, bytes(data)


def check_hostile_loads(files, name: str, count: int) -> dict[str, int]:
    good = (files / name).read_bytes()
    bad = files / ("bad" + (files / name).suffix)
    models = files / "models"
    registry = ModelRegistry(
        [models],
        "plain",
        max_resident=2,
        settings=lambda model: LoadSettings(dit=bad) if model == "hostile" else LoadSettings(),
    )
    plain = registry.acquire("plain")
    rng = random.Random(name)
    outcomes: dict[str, int] = {}
    for _ in range(count):
        kind, data = mutated(good, rng)
        bad.write_bytes(data)
        try:
            loaded = registry.acquire("hostile")
        except ContractError as refused:
            assert refused.status == 400 and str(bad) in refused.message, refused.message
            outcome = "refused"
        else:
            registry.release(loaded)
            registry.unload("hostile")
            outcome = "loaded"
        outcomes[f"{kind} {outcome}"] = outcomes.get(f"{kind} {outcome}", 0) + 1
    assert "plain" in registry.resident_ids()
    cond = np.zeros((1, 4, plain.model.dit.config.joint_attention_dim), np.float32)
    x = np.zeros((1, 128, 2, 2), np.float32)
    schedule = np.float32([1.0, 0.5, 0.0])
    out = plain.model.denoise_step(
        x, np.float32([1.0]), [StepRow(cond, "wire:c")], sample_sigmas=schedule
    )
    assert np.isfinite(out.out).all()
    print(f"FIGURE hostile {name}: {count} files, {outcomes}")
    return outcomes


@pytest.mark.parametrize("name", ["dit.gguf", "bfl.safetensors"])
def test_hostile_dit_files_are_refused_400_or_load(files, name):
    outcomes = check_hostile_loads(files, name, QUICK)
    assert any(key.endswith("refused") for key in outcomes)


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["dit.gguf", "bfl.safetensors"])
def test_hostile_dit_files_long_run(files, name):
    check_hostile_loads(files, name, HEAVY)


def relabelled(path, name: str, dtype: str) -> None:
    """`path` with tensor `name`'s header dtype changed to `dtype` (same item size: the file
    stays whole)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header[name]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(text) == length
    path.write_bytes(data[:8] + text + data[8 + length :])


def as_float8(path, name: str) -> None:
    """`path` with tensor `name` stored as float8 (E4M3), as ComfyUI's fp8 files hold weights."""
    import torch
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    tensors = load_torch(str(path))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_torch(tensors, str(path))


def as_float64(path, name: str) -> None:
    """`path` with tensor `name` stored as float64, which MLX cannot load."""
    tensors = load_file(str(path))
    tensors[name] = tensors[name].astype(np.float64)
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    ("component", "change", "said"),
    [
        ("vae", as_float8, "is stored as F8_E4M3; the server reads F32, F16 and BF16 weights; for"),
        ("text_encoder", lambda path, name: relabelled(path, name, "I32"), "is stored as I32"),
        ("text_encoder", as_float64, "is stored as F64"),
    ],
)
def test_tensors_in_dtypes_the_server_does_not_read_are_refused_before_loading(
    files, tmp_path, component, change, said
):
    models = tmp_path / "models"
    shutil.copytree(files / "models" / "plain", models / "plain")
    shutil.copytree(files / "models" / "plain", models / "odd")
    (path,) = (models / "odd" / component).glob("*.safetensors")
    name = next(n for n in load_file(str(path)) if n.endswith("weight"))
    change(path, name)
    registry = ModelRegistry([models], "plain", max_resident=1)
    registry.release(registry.acquire("plain"))
    with pytest.raises(ContractError) as refused:
        registry.acquire("odd")
    assert refused.value.status == 400
    assert f"{path}: tensor {name} {said}" in refused.value.message
    assert registry.resident_ids() == ["plain"]
