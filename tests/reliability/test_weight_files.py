"""Hostile weight files: a FLUX.3 klein DiT as a GGUF file (every readable type mixed, as the
conformance suite writes it) and as BFL's single safetensors file, cut short at random points,
bytes flipped anywhere and in the header, named by a model entry's `dit`. Every load either
succeeds (a flipped weight is still a weight) or is refused 400 naming the file, never another
error, and a model loaded beside stays loaded and steps."""

from __future__ import annotations

import random
import shutil

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
