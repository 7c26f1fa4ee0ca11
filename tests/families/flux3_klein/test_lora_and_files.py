"""FLUX.3 klein's DiT from the files users have, and its LoRA files:

- a single safetensors file in BFL's naming (its own checkpoints) steps as diffusers' folder,
  and the test's BFL writer is what diffusers' single-file conversion reads back;
- LoRA files through `--adapter` (gmlx_server.lora_files) in each key form (diffusers and
  PEFT; kohya; ComfyUI's; and BFL's, `diffusion_model.` over BFL's names, through the
  manifest's `lora_aliases`) against peft on diffusers' Flux3Transformer2DModel, on q, k and v
  (fused here), the MLP, the per-mode blocks of each mode, the modulations and the embedders."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gmlx_contract import wire
from gmlx_server.engine.base import StepRow
from gmlx_server.lora_files import AdapterSpec, adapter_table
from safetensors.numpy import load_file, save_file

from tests.compare import rel_l2
from tests.families.flux3_klein.bfl import bfl_layer, bfl_state_dict
from tests.families.flux3_klein.reference import reference_dit
from tests.families.flux3_klein.tiny import build_tiny_folder
from tests.families.routes import loaded_folder
from tests.lora.forms import FORMS, random_lora, write_form, write_lora_file
from tests.lora.reference import layer_shapes, peft_model

LAYERS = (
    "single_transformer_blocks.0.attn.to_q",
    "single_transformer_blocks.0.attn.to_k",
    "single_transformer_blocks.0.attn.to_v",
    "single_transformer_blocks.1.attn.to_out.0",
    "single_transformer_blocks.1.ff.linear_in",
    "txt_mode_blocks.0.ff.linear_out",
    "mode_blocks.image.0.attn.to_q",
    "mode_blocks.image_cond.0.attn.to_v",
    "early_stream_modulations.image.linear",
    "single_stream_modulations.txt.linear",
    "x_embedders.image",
    "x_embedders.image_cond",
    "context_embedder",
    "timestep_embedder.linear_1",
    "target_timestep_embedder.linear_2",
    "proj_out",
)
SCHEDULE = np.float32([1.0, 0.6, 0.3, 0.0])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny distilled folder, and a copy whose transformer/ is one BFL-named file."""
    root = tmp_path_factory.mktemp("flux3_files")
    folder = build_tiny_folder(root / "flux3-tiny")
    bfl = root / "flux3-bfl-tiny"
    shutil.copytree(folder, bfl, ignore=shutil.ignore_patterns("transformer"))
    (bfl / "transformer").mkdir()
    shutil.copy(folder / "transformer" / "config.json", bfl / "transformer" / "config.json")
    weights = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    save_file(bfl_state_dict(weights), str(bfl / "transformer" / "flux3-klein.safetensors"))
    return folder, loaded_folder(folder), loaded_folder(bfl)


def transformer(folder):
    from diffusers import Flux3Transformer2DModel

    return Flux3Transformer2DModel.from_pretrained(str(folder / "transformer")).eval()


def inputs(model, seed: int):
    rng = np.random.default_rng(seed)
    cond = rng.standard_normal((5, model.dit.config.joint_attention_dim)).astype(np.float32)
    x = rng.standard_normal((1, 128, 3, 4)).astype(np.float32)
    ref = rng.standard_normal((128, 2, 2)).astype(np.float32)
    return cond, x, ref


def step(model, cond, x, ref, table=None) -> np.ndarray:
    row = StepRow(cond[None], "wire:c", (ref,), ("wire:r",))
    return model.denoise_step(x, np.float32([0.6]), [row], table=table, sample_sigmas=SCHEDULE).out


def test_the_bfl_writer_is_what_diffusers_converts_back(folders):
    from diffusers.loaders.single_file_utils import (
        convert_flux3_transformer_checkpoint_to_diffusers,
    )

    folder, _, _ = folders
    weights = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    bfl = {k: torch.from_numpy(v) for k, v in bfl_state_dict(weights).items()}
    back = convert_flux3_transformer_checkpoint_to_diffusers(bfl)
    assert sorted(back) == sorted(weights)
    assert all(np.array_equal(back[k].numpy(), weights[k]) for k in weights)


def test_a_bfl_single_file_steps_as_the_folder(folders):
    _, plain, bfl = folders
    cond, x, ref = inputs(plain.model, 1)
    assert np.array_equal(step(bfl.model, cond, x, ref), step(plain.model, cond, x, ref))
    plain_manifest, bfl_manifest = plain.model.manifest(), bfl.model.manifest()
    assert [t["name"] for t in bfl_manifest["tensors"]] == [
        t["name"] for t in plain_manifest["tensors"]
    ]


@pytest.mark.parametrize("form", [*FORMS, "peft", "bfl"])
def test_a_lora_file_in_each_key_form_runs_as_peft_does(tmp_path, folders, form):
    folder, loaded, _ = folders
    shapes = layer_shapes(transformer(folder))
    alpha = None if form in ("diffusers", "peft") else 8.0
    lora = random_lora(shapes, seed=11, alpha=alpha, layers=LAYERS)
    if form == "bfl":  # `diffusion_model.` over BFL's layer names
        state = {_bfl_key(key): value for key, value in write_form(lora, "comfy").items()}
        _check_diffusers_reads(state, lora)
        path = tmp_path / "bfl.safetensors"
        path.write_bytes(wire.write_container(state))
    else:
        path = write_lora_file(tmp_path, lora, form)
    table = adapter_table(loaded, [AdapterSpec(path, 0.7)])
    cond, x, ref = inputs(loaded.model, 12)
    reference = peft_model(folder, [(lora, 0.7)], transformer(folder))
    theirs = reference_dit(reference, x, [0.6], cond[None], [ref[None]], targets=[0.3])
    assert rel_l2(step(loaded.model, cond, x, ref, table), theirs) <= 1e-4
    assert rel_l2(step(loaded.model, cond, x, ref, table), step(loaded.model, cond, x, ref)) > 0.05


def _bfl_key(key: str) -> str:
    stem = key.removeprefix("diffusion_model.")
    for suffix in (".lora_down.weight", ".lora_up.weight", ".alpha"):
        if stem.endswith(suffix):
            return "diffusion_model." + bfl_layer(stem[: -len(suffix)]) + suffix
    raise AssertionError(key)


def _check_diffusers_reads(state: dict, lora) -> None:
    """Diffusers' own FLUX.3 LoRA loading maps the BFL keys of the blocks onto the LoRA's
    layers (it renames block names only; the names outside the blocks are its checkpoint
    conversion's, which test_the_bfl_writer_is_what_diffusers_converts_back checks)."""
    from diffusers.loaders.lora_pipeline import Flux3LoraLoaderMixin

    converted = Flux3LoraLoaderMixin.lora_state_dict(
        {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}
    )
    layers = {
        k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in converted if ".lora_" in k
    }
    blocks = {layer for layer in lora.pairs if "blocks." in layer}
    assert {layer for layer in layers if "blocks." in layer} == blocks
