"""The LoRA key map of the pack's model: every key form the server's own `--adapter` loader reads
maps onto the same weight through the stock loaders' key map (gmlx_contract.lora_keys)."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_comfy.patches import lora_key_map, unmapped_patches_text
from gmlx_contract.lora_keys import SUFFIXES, LayerNames, linear_layers, stems_of

from tests.lora.forms import LAYERS, random_lora, write_form

MANIFEST = {
    "tensors": [{"name": f"{layer}.weight", "shape": [8, 6], "dtype": "bf16"} for layer in LAYERS]
    + [
        {"name": "transformer_blocks.0.attn.to_q.bias", "shape": [8], "dtype": "bf16"},
        {"name": "transformer_blocks.0.attn.norm_q.weight", "shape": [8], "dtype": "bf16"},
    ]
}
SHAPES = {layer: (8, 6) for layer in LAYERS}
# ComfyUI's LoRAAdapter reads a pair as `<stem>.lora_up.weight` / `.lora_down.weight` or
# `<stem>.lora_B.weight` / `.lora_A.weight`, and `<stem>.alpha` (comfy/weight_adapter/lora.py).
COMFY_PAIR_SUFFIXES = (".lora_up.weight", ".lora_down.weight", ".lora_B.weight", ".lora_A.weight")


def _renamed(state: dict, old: str, new: str) -> dict:
    return {new + key.removeprefix(old): value for key, value in state.items()}


def _files() -> dict[str, dict[str, np.ndarray]]:
    """The same LoRA in every form: the three writers of tests/lora/forms.py, and the prefixes
    the server's loader also strips (PEFT's save_pretrained, model.diffusion_model., none)."""
    with_alpha = random_lora(SHAPES, seed=1, rank=2, alpha=1.0)
    no_alpha = random_lora(SHAPES, seed=1, rank=2, alpha=None)
    diffusers = write_form(no_alpha, "diffusers")
    comfy = write_form(with_alpha, "comfy")
    return {
        "diffusers": diffusers,
        "kohya": write_form(with_alpha, "kohya"),
        "comfy": comfy,
        "peft": _renamed(diffusers, "transformer.", "base_model.model."),
        "bare": _renamed(diffusers, "transformer.", ""),
        "model.diffusion_model": _renamed(comfy, "diffusion_model.", "model.diffusion_model."),
    }


def _stem_and_suffix(key: str) -> tuple[str, str]:
    suffix = next(s for s in SUFFIXES if key.endswith(s))
    return key[: -len(suffix)], suffix


def test_the_key_map_covers_linear_weights_only():
    key_map = lora_key_map(MANIFEST)
    targets = set(key_map.values())
    assert targets == {f"diffusion_model.{layer}.weight" for layer in LAYERS}
    assert linear_layers(MANIFEST) == list(LAYERS)


@pytest.mark.parametrize("form", sorted(_files()))
def test_every_form_maps_through_the_stock_key_map_as_the_server_reads_it(form):
    """Each key of the file is `<stem><suffix>` with a stem of the key map and a suffix ComfyUI
    reads; the stem lands on the layer the server's loader reads it as."""
    state = _files()[form]
    key_map = lora_key_map(MANIFEST)
    names = LayerNames(linear_layers(MANIFEST))
    landed = set()
    for key in state:
        stem, suffix = _stem_and_suffix(key)
        assert suffix in COMFY_PAIR_SUFFIXES + (".alpha",)
        assert stem in key_map, key
        layer = names.layer_of(stem)
        assert key_map[stem] == f"diffusion_model.{layer}.weight"
        landed.add(layer)
    assert landed == set(LAYERS)


def test_the_server_loader_reads_every_form_onto_the_same_layers():
    from gmlx_server.lora_files import layer_parts
    from gmlx_server.service import CachedTensor

    layers = linear_layers(MANIFEST)
    for form, state in _files().items():
        tensors = {k: CachedTensor(np.asarray(v, np.float32), "F32") for k, v in state.items()}
        assert set(layer_parts(tensors, layers)) == set(LAYERS), form


def test_stems_name_one_layer_each():
    layers = linear_layers(MANIFEST)
    names = LayerNames(layers)
    for layer in layers:
        for stem in stems_of(layer):
            assert names.layer_of(stem) == layer
    assert names.layer_of("transformer.transformer_blocks.9.attn.to_q") is None
    assert names.layer_of("lora_te_text_model_encoder_layers_0_mlp_fc1") is None


def test_the_refusal_names_the_file_and_the_forms():
    text = unmapped_patches_text("the LoRA file 'style.safetensors'", "tiny", [])
    assert "'style.safetensors'" in text and "'tiny'" in text
    for form in ("diffusion_model.<layer>", "transformer.<layer>", "base_model.model.<layer>"):
        assert form in text
    assert "lora_unet_" in text
    text = unmapped_patches_text("node 5 (ModelMergeSimple)", "tiny", ["a.weight", "b.weight"])
    assert "node 5 (ModelMergeSimple)" in text and "a.weight, ..." in text
