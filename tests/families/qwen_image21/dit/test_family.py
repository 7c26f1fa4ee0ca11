"""QwenImage21Model: identify, status, manifest, and the loaded model's step, encode and VAE."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.qwen_image21 import family
from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
from safetensors import safe_open

from tests.comfy.test_schedule import QWEN_RULE
from tests.compare import rel_l2
from tests.families.qwen_image21.dit.folder import SCHEDULER_CONFIG, TURBO_SIGMAS, build_folder
from tests.families.qwen_image21.dit.reference import reference_row

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_base")
    model = build_folder(root, variant="base")
    return root, model


@pytest.fixture(scope="module")
def loaded(base_folder):
    root, model = base_folder
    loaded = family.QWEN_IMAGE21.load(root, "qwen_base")
    yield loaded, model
    loaded.close()


def test_identify(tmp_path, base_folder):
    assert family.QWEN_IMAGE21.spec.identify(base_folder[0]) == ("qwen_image21", "base")
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "QwenImage21Pipeline", "sample_sigmas": [1.0, 0.5]})
    )
    assert family.QWEN_IMAGE21.spec.identify(tmp_path) == ("qwen_image21", "turbo")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert family.QWEN_IMAGE21.spec.identify(tmp_path) is None


def test_status_of_the_base_variant(loaded, base_folder):
    model, _ = loaded
    status = model.status()
    assert status["comfy"] == {"model_class": "QwenImage21", "image_model": "qwen_image21"}
    assert status["latent"] == {"channels": 16, "stride": 16, "patch": 1}
    vae_config = json.loads((base_folder[0] / "vae" / "config.json").read_text())
    assert status["vae"] == {
        "channels_out": 4,
        "stride": 16,
        "latents_mean": vae_config["latents_mean"],
        "latents_std": vae_config["latents_std"],
    }
    assert status["edit_capable"] is True
    assert status["compute_dtype"] == "f32"
    assert status["sampling"] == {
        "steps": 40,
        "cfg": 1.0,
        "shift": 1.0,
        "sigmas": None,
        "neg_skip": [],
        "timestep_scale": 1.0,
        "schedule": {
            "rule": "qwen_image21",
            "base_len": SCHEDULER_CONFIG["base_image_seq_len"],
            "max_len": SCHEDULER_CONFIG["max_image_seq_len"],
            "base_shift": SCHEDULER_CONFIG["base_shift"],
            "max_shift": SCHEDULER_CONFIG["max_shift"],
            "terminal": SCHEDULER_CONFIG["shift_terminal"],
        },
    }
    memory = status["memory"]
    root = base_folder[0]
    dit_file = sum(p.stat().st_size for p in (root / "transformer").glob("*.safetensors"))
    assert 0 < memory["dit_bytes"] < dit_file
    assert memory["encoder_bytes"] > 0 and memory["vae_bytes"] > 0
    assert memory["resident_bytes"] > memory["activation_reserve_bytes"] > 0  # loaded
    # a loaded model's footprint counts its arrays (the file's lm_head is never loaded)
    reserve = family.QWEN_IMAGE21.activation_reserve(root, model.dit.dtype)
    assert memory["resident_bytes"] == model.weight_bytes + reserve
    described = family.QWEN_IMAGE21.describe(root, "qwen_base")
    assert described["memory"]["resident_bytes"] == 0  # not resident
    described["memory"] = memory
    # residency: nothing held before the load, each component's bytes from the headers (the
    # VAE's file also holds temporal convolutions that never load)
    estimate, held = described.pop("residency"), status.pop("residency")
    assert described == status
    for name, component in held.items():
        assert component["resident"] and not estimate[name]["resident"]
        assert component["dtype"] == estimate[name]["dtype"] == "f32"
        assert 0 < component["bytes"] <= estimate[name]["bytes"]
    assert held["dit"]["bytes"] == estimate["dit"]["bytes"] == model.dit.weight_bytes


def test_sampling_rows_without_scheduler_config_and_for_turbo(tmp_path):
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "QwenImage21Pipeline", "sample_sigmas": TURBO_SIGMAS})
    )
    assert family.sampling_row(tmp_path) == {
        "steps": 4,
        "cfg": 1.0,
        "shift": 1.0,
        "sigmas": [*TURBO_SIGMAS, 0.0],
        "schedule": None,
        "neg_skip": [],
    }
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImage21Pipeline"}))
    assert family.sampling_row(tmp_path)["schedule"] == QWEN_RULE  # what the pack's node reads


def test_manifest_lists_the_transformer_tensors(loaded, base_folder):
    model, torch_model = loaded
    manifest = model.manifest()
    state = torch_model.state_dict()
    assert manifest["family"] == "qwen_image21" and manifest["naming"] == "diffusers"
    assert manifest["arch"] is None and manifest["inline"] == {}
    assert manifest["count"] == len(state) == len(manifest["tensors"])
    for tensor in manifest["tensors"]:
        assert tensor["shape"] == list(state[tensor["name"]].shape)
        assert tensor["dtype"] == "f32"
    assert "transformer_blocks.0.attn.to_q.weight" in {t["name"] for t in manifest["tensors"]}


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bf16"), (torch.float16, "f16")])
def test_half_precision_files_load_and_match(tmp_path, base_folder, dtype, name):
    from diffusers import QwenImage21Transformer2DModel

    root, _ = base_folder
    half = QwenImage21Transformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype)
    half.save_pretrained(tmp_path / "transformer")
    (tmp_path / "model_index.json").write_text((root / "model_index.json").read_text())
    assert {t["dtype"] for t in family.QWEN_IMAGE21.manifest(tmp_path)["tensors"]} == {name}
    reference = half.float()
    dit = QwenImage21DiT.load(tmp_path / "transformer")
    assert dit.dtype == mx.float32
    rng = np.random.default_rng(1)
    cond = rng.standard_normal((1, 6, 64)).astype(np.float32)
    x = rng.standard_normal((1, 16, 4, 4)).astype(np.float32)
    from gmlx_server.engine.families.qwen_image21.step import PrefixCache, denoise_step

    row = StepRow(cond=cond, cond_key="wire:h")
    out = denoise_step(dit, PrefixCache(0), x, np.float32(0.7), [row]).out
    assert rel_l2(out[0], reference_row(reference, cond[0], x[0], 0.7)) <= TOLERANCE


def test_step_through_the_model_and_run_end(loaded):
    model, torch_model = loaded
    rng = np.random.default_rng(2)
    cond = rng.standard_normal((1, 5, 64)).astype(np.float32)
    x = rng.standard_normal((1, 16, 2, 4)).astype(np.float32)
    rows = [StepRow(cond=cond, cond_key="wire:s")]
    first = model.denoise_step(x, np.float32(0.5), rows, run="run1")
    second = model.denoise_step(x, np.float32(0.5), rows, run="run1")
    assert (first.prefix_cache, second.prefix_cache) == ("miss", "hit")
    assert first.forward_ms > 0
    assert rel_l2(first.out[0], reference_row(torch_model, cond[0], x[0], 0.5)) <= TOLERANCE
    model.end_run("run1")
    assert model.denoise_step(x, np.float32(0.5), rows).prefix_cache == "miss"


def test_encode_then_step_with_references(loaded):
    model, torch_model = loaded
    rng = np.random.default_rng(3)
    images = [
        rng.integers(0, 256, (256, 320, 3), dtype=np.uint8),
        rng.integers(0, 256, (256, 256, 4), dtype=np.uint8),
    ]
    encoded = model.encode("a red cube on a table", images, refs=True)
    assert encoded.cond.ndim == 3 and encoded.cond.shape[2] == 64
    assert len(encoded.ref_latents) == 2 and len(encoded.image_slots) == 2
    for latent in encoded.ref_latents:
        assert latent.shape[:2] == (1, 16) and latent.dtype == np.float32
    no_refs = model.encode("a red cube on a table", images, refs=False)
    assert no_refs.ref_latents == [] and no_refs.image_slots == encoded.image_slots

    row = StepRow(
        cond=encoded.cond,
        cond_key="wire:e",
        ref_latents=tuple(encoded.ref_latents),
        ref_keys=("a", "b"),
        image_slots=tuple(encoded.image_slots),
    )
    x = rng.standard_normal((1, 16, 4, 4)).astype(np.float32)
    out = model.denoise_step(x, np.float32(0.9), [row]).out
    expected = reference_row(
        torch_model,
        encoded.cond[0],
        x[0],
        0.9,
        [r[0] for r in encoded.ref_latents],
        encoded.image_slots,
    )
    assert rel_l2(out[0], expected) <= TOLERANCE


def test_vae_round_trip_shapes(loaded):
    model, _ = loaded
    rng = np.random.default_rng(4)
    image = rng.random((32, 48, 4), dtype=np.float32)
    latents = model.vae_encode(image)
    assert latents.shape == (16, 2, 3) and latents.dtype == np.float32
    rgb = model.vae_decode(latents, alpha=False)
    rgba = model.vae_decode(latents, alpha=True)
    assert rgb.shape == (32, 48, 3) and rgba.shape == (32, 48, 4)
    assert np.array_equal(rgb, rgba[..., :3])
    assert rgb.min() >= 0.0 and rgb.max() <= 1.0


def test_weights_are_read_by_their_file_names(base_folder):
    root, _ = base_folder
    with safe_open(str(next((root / "transformer").glob("*.safetensors"))), "np") as handle:
        names = set(handle.keys())
    assert "modulation.1.weight" in names and "txt_in.text_norm.weight" in names
