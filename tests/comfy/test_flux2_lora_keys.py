"""The pack's LoRA key map on FLUX.2 klein: ComfyUI's own Flux2 weight names (BFL's) are the
manifest's `lora_aliases`, so a LoRA file keyed by them loads through the stock key map as it
loads on ComfyUI's Flux2, and its patches on those weights land on the manifest's layers as the
server's `--adapter` loader lands the same file (fused q/k/v split by rows, linear1 whole, the
final modulation's halves swapped onto norm_out.linear)."""

from __future__ import annotations

import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gmlx_comfy import stock
from gmlx_comfy.errors import GmlxError
from gmlx_comfy.patches import AdapterHashes, Aliases, build_table, lora_key_map
from gmlx_contract.lora_keys import SUFFIXES, Rows, alias_landings, layer_aliases, layer_rows
from gmlx_server.config import AdapterSpec
from gmlx_server.engine.families.flux2_klein import family as klein
from gmlx_server.lora_files import adapter_doc
from safetensors.numpy import save_file

from tests.comfy.test_patches import LoRAAdapter
from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.lora.forms import random_lora

DOUBLE_BLOCKS, SINGLE_BLOCKS = 2, 2  # the tiny klein's
# The linear weights of ComfyUI's Flux2 model for klein (comfy/ldm/flux/model.py with
# global_modulation and mlp_silu_act: layers.DoubleStreamBlock, SingleStreamBlock, LastLayer,
# MLPEmbedder, Modulation), less the `diffusion_model.` prefix.
COMFY_TOP = (
    "img_in",
    "txt_in",
    "time_in.in_layer",
    "time_in.out_layer",
    "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.lin",
    "single_stream_modulation.lin",
    "final_layer.linear",
    "final_layer.adaLN_modulation.1",
)
COMFY_DOUBLE = ("img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2")
COMFY_DOUBLE += tuple(name.replace("img_", "txt_") for name in COMFY_DOUBLE)
COMFY_SINGLE = ("linear1", "linear2")
COMFY_FLUX2_LINEARS = (
    COMFY_TOP
    + tuple(f"double_blocks.{i}.{n}" for i in range(DOUBLE_BLOCKS) for n in COMFY_DOUBLE)
    + tuple(f"single_blocks.{i}.{n}" for i in range(SINGLE_BLOCKS) for n in COMFY_SINGLE)
)
STRENGTH = 0.6


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_keys") / "klein-tiny"
    build_tiny_folder(folder, family="flux2_klein")
    return klein.FLUX2_KLEIN.manifest(folder)


def _shapes(manifest):
    columns = {t["name"].removesuffix(".weight"): t["shape"][-1] for t in manifest["tensors"]}
    return {
        alias: (sum(p.length for p in pieces), columns[pieces[0].layer])
        for alias, pieces in layer_aliases(manifest).items()
    }


def _stem_and_suffix(key: str) -> tuple[str, str]:
    suffix = next(s for s in SUFFIXES if key.endswith(s))
    return key[: -len(suffix)], suffix


def test_the_aliases_are_comfyuis_flux2_weights(manifest):
    assert set(layer_aliases(manifest)) == set(COMFY_FLUX2_LINEARS)
    key_map = lora_key_map(manifest)
    for name in COMFY_FLUX2_LINEARS:
        weight = f"diffusion_model.{name}.weight"
        for stem in (f"diffusion_model.{name}", "lora_unet_" + name.replace(".", "_"), name):
            assert key_map[stem] == weight


def _state(lora, form: str) -> dict[str, np.ndarray]:
    state = {}
    for name, (a, b) in lora.pairs.items():
        if form == "ai-toolkit":
            stem = f"diffusion_model.{name}"
            state[f"{stem}.lora_A.weight"], state[f"{stem}.lora_B.weight"] = a, b
            continue
        stem = (
            "lora_unet_" + name.replace(".", "_") if form == "kohya" else f"diffusion_model.{name}"
        )
        state[f"{stem}.lora_down.weight"], state[f"{stem}.lora_up.weight"] = a, b
        state[f"{stem}.alpha"] = np.array(lora.alpha, np.float32)
    return state


def _comfy_patches(state, key_map) -> dict[str, list[tuple]]:
    """What the stock loader makes of the file through the key map (comfy.lora.load_lora,
    ModelPatcher.add_patches): one LoRA patch per weight, (strength, adapter, 1.0, offset,
    None)."""
    stems: dict[str, dict] = {}
    for key, value in state.items():
        stem, suffix = _stem_and_suffix(key)
        stems.setdefault(stem, {})[SUFFIXES[suffix]] = torch.from_numpy(np.asarray(value))
    patches = {}
    for stem, parts in stems.items():
        target = key_map[stem]
        alpha = parts.get("alpha")
        adapter = LoRAAdapter((parts["up"], parts["down"], alpha, None, None, None))
        patches[target] = [(STRENGTH, adapter, 1.0, None, None)]
    return patches


def _landed(entries, arrays) -> dict[tuple, list[tuple]]:
    """(key, band) -> [(up, down, alpha, strength)] of a table document's entries."""
    return {
        (e["key"], tuple(e["band"] or ())): [
            (
                np.asarray(arrays[p["up"]], np.float32).tolist(),
                np.asarray(arrays[p["down"]], np.float32).tolist(),
                p["alpha"],
                p["strength"],
            )
            for p in e["patches"]
        ]
        for e in entries
    }


@pytest.mark.parametrize("form", ["ai-toolkit", "kohya", "comfy"])
def test_a_bfl_lora_through_the_key_map_lands_as_the_server_loader_lands_it(
    tmp_path, manifest, form
):
    lora = random_lora(_shapes(manifest), seed=4, rank=2, alpha=1.0, layers=COMFY_FLUX2_LINEARS)
    state = _state(lora, form)
    path = tmp_path / "bfl.safetensors"
    save_file(state, str(path))
    pack = build_table(
        "klein",
        _comfy_patches(state, lora_key_map(manifest)),
        AdapterHashes(),
        None,
        Aliases(manifest),
    )
    server_doc, server_arrays = adapter_doc("klein", manifest, [AdapterSpec(path, STRENGTH)])
    server_arrays = {h: t.float32() for h, t in server_arrays.items()}
    if form == "ai-toolkit":  # ComfyUI reads no alpha there either: scale 1 on both sides
        assert all(p["alpha"] is None for e in pack.doc["entries"] for p in e["patches"])
    assert _landed(pack.doc["entries"], pack.adapters) == _landed(
        server_doc["entries"], server_arrays
    )
    keys = {e["key"] for e in pack.doc["entries"]}
    assert keys <= {f"diffusion_model.{t['name']}" for t in manifest["tensors"]}
    named = {p[s] for e in pack.doc["entries"] for p in e["patches"] for s in ("up", "down")}
    assert set(pack.adapters) == named  # the whole fused up matrices do not travel


def test_comfyuis_flux_entries_on_bfl_weights_give_way_to_the_packs(manifest):
    """ComfyUI's Flux key map sends diffusers names onto BFL's weights (q/k/v by offsets into
    the fused qkv, norm_out.linear through its swap function): on the pack's model those are
    alias placeholders, so the pack's own entry onto the manifest's layer takes their place."""

    def comfy_flux(model, key_map={}):  # noqa: B006 - ComfyUI's own signature
        for k in model.state_dict():
            key_map[k.removesuffix(".weight")] = k
        key_map["transformer.transformer_blocks.0.attn.to_k"] = (
            "diffusion_model.double_blocks.0.img_attn.qkv.weight",
            (0, 64, 64),
        )
        key_map["transformer.norm_out.linear"] = (
            "diffusion_model.final_layer.adaLN_modulation.1.weight",
            None,
            lambda weight: weight,
        )
        key_map["transformer.proj_out"] = "diffusion_model.final_layer.linear.weight"
        return key_map

    lora = types.SimpleNamespace(model_lora_keys_unet=comfy_flux)
    stock.install(lora, types.SimpleNamespace(fix_empty_latent_channels=lambda m, x: x))
    aliases = Aliases(manifest)
    weights = [f"diffusion_model.{t['name']}" for t in manifest["tensors"]]
    weights += sorted(aliases.weights)
    model = SimpleNamespace(
        state_dict=lambda: dict.fromkeys(weights),
        gmlx_lora_keys=lora_key_map(manifest),
        gmlx_alias_weights=aliases.weights,
    )
    key_map = lora.model_lora_keys_unet(model, {})
    assert key_map["transformer.transformer_blocks.0.attn.to_k"] == (
        "diffusion_model.transformer_blocks.0.attn.to_k.weight"
    )
    assert key_map["transformer.norm_out.linear"] == "diffusion_model.norm_out.linear.weight"
    assert key_map["transformer.proj_out"] == "diffusion_model.proj_out.weight"
    qkv = "diffusion_model.double_blocks.0.img_attn.qkv"
    assert key_map[qkv] == qkv + ".weight"  # BFL's own stems stay on the alias


def test_an_offset_into_a_fused_weight_lands_on_its_part(manifest):
    """A patch ComfyUI places by offset on a BFL weight (its Flux map's `linear1_qkv`, or rows
    of qkv) lands on the manifest layers those rows are."""
    up, down = torch.ones(64, 2), torch.ones(2, 64)
    patches = {
        "diffusion_model.double_blocks.1.txt_attn.qkv.weight": [
            (1.0, LoRAAdapter((up, down, None, None, None, None)), 1.0, (0, 64, 64), None)
        ],
        "diffusion_model.final_layer.adaLN_modulation.1.weight": [
            (1.0, LoRAAdapter((up, down, None, None, None, None)), 1.0, (0, 32, 64), None)
        ],
    }
    table = build_table("klein", patches, AdapterHashes(), None, Aliases(manifest))
    landed = [(e["key"], e["band"]) for e in table.doc["entries"]]
    assert landed == [
        ("diffusion_model.norm_out.linear.weight", [0, 0, 32]),
        ("diffusion_model.norm_out.linear.weight", [0, 96, 32]),
        ("diffusion_model.transformer_blocks.1.attn.add_k_proj.weight", None),
    ]


def test_a_patch_that_does_not_fit_its_alias_is_refused_naming_it(manifest):
    up, down = torch.ones(64, 2), torch.ones(2, 64)
    patches = {
        "diffusion_model.double_blocks.0.img_attn.qkv.weight": [
            (1.0, LoRAAdapter((up, down, None, None, None, None)), 1.0, None, None)
        ]
    }
    with pytest.raises(GmlxError, match="img_attn.qkv.*up has 64 rows, the layer has 192"):
        build_table("klein", patches, AdapterHashes(), None, Aliases(manifest))


def test_alias_landings_split_rows_and_pass_column_bands():
    pieces = (Rows("q", 0, 4), Rows("k", 0, 4), Rows("v", 0, 4))
    rows = {"q": 4, "k": 4, "v": 4, "mod": 8}
    whole = alias_landings("qkv", pieces, None, 12, rows)
    assert [(x.layer, x.band, x.up_rows) for x in whole] == [
        ("q", None, slice(0, 4)),
        ("k", None, slice(4, 8)),
        ("v", None, slice(8, 12)),
    ]
    across = alias_landings("qkv", pieces, [0, 2, 4], 4, rows)
    assert [(x.layer, x.band, x.up_rows) for x in across] == [
        ("q", [0, 2, 2], slice(0, 2)),
        ("k", [0, 0, 2], slice(2, 4)),
    ]
    columns = alias_landings("qkv", pieces, [1, 0, 3], 12, rows)
    assert [x.band for x in columns] == [[1, 0, 3]] * 3
    swapped = (Rows("mod", 4, 4), Rows("mod", 0, 4))
    assert [(x.band, x.up_rows) for x in alias_landings("final", swapped, None, 8, rows)] == [
        ([0, 4, 4], slice(0, 4)),
        ([0, 0, 4], slice(4, 8)),
    ]
    with pytest.raises(ValueError, match="runs past its 12 output rows"):
        alias_landings("qkv", pieces, [0, 10, 4], 4, rows)
    with pytest.raises(ValueError, match="cannot split over its rows"):
        alias_landings("final", swapped, [1, 0, 2], 8, rows)


def test_manifest_rows_and_aliases_read_as_published(manifest):
    rows = layer_rows(manifest)
    aliases = layer_aliases(manifest)
    assert aliases["final_layer.adaLN_modulation.1"] == (
        Rows("norm_out.linear", 64, 64),
        Rows("norm_out.linear", 0, 64),
    )
    assert aliases["single_blocks.1.linear1"] == (
        Rows("single_transformer_blocks.1.attn.to_qkv_mlp_proj", 0, 576),
    )
    assert rows["transformer_blocks.0.attn.to_q"] == 64
    assert layer_aliases({"tensors": []}) == {}
