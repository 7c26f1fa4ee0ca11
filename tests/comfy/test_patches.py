"""LoRA patch dicts shaped as ComfyUI builds them -> adapters and a patch table (§7.7)."""

import numpy as np
import pytest
import torch
from gmlx_comfy.errors import GmlxError
from gmlx_comfy.patches import AdapterHashes, build_table
from gmlx_contract.hashing import canonical_json, table_id, tensor_hash

KEY_Q = "diffusion_model.transformer_blocks.0.attn.to_q.weight"
KEY_K = "diffusion_model.transformer_blocks.0.attn.to_k.weight"


class LoRAAdapter:
    """Shaped like comfy.weight_adapter.lora.LoRAAdapter (ComfyUI 0.3.64): name + weights."""

    name = "lora"

    def __init__(self, weights):
        self.loaded_keys = set()
        self.weights = weights


class LoKrAdapter(LoRAAdapter):
    name = "lokr"


def _pair(seed, rank=4, out=16, inn=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, rank, generator=g).to(dtype), torch.randn(rank, inn, generator=g).to(
        dtype
    )


def _entry(value, strength=1.0, strength_model=1.0, offset=None, function=None):
    # ModelPatcher.add_patches appends (strength_patch, value, strength_model, offset, function)
    return (strength, value, strength_model, offset, function)


def test_plain_lora_becomes_a_table_with_adapters():
    up, down = _pair(0)
    patches = {KEY_Q: [_entry(LoRAAdapter((up, down, 16.0, None, None, None)), 0.8)]}
    table = build_table("qwen-tiny", patches, AdapterHashes())
    h_up, h_down = tensor_hash(up.numpy()), tensor_hash(down.numpy())
    assert table.doc == {
        "model": "qwen-tiny",
        "entries": [
            {
                "key": KEY_Q,
                "band": None,
                "patches": [
                    {
                        "up": h_up,
                        "down": h_down,
                        "alpha": 16.0,
                        "strength": 0.8,
                        "strength_model": 1.0,
                    }
                ],
            }
        ],
    }
    assert set(table.adapters) == {h_up, h_down}
    np.testing.assert_array_equal(table.adapters[h_up], up.numpy())
    # the id the server computes from the canonical body
    assert len(table_id(table.doc)) == 64 and canonical_json(table.doc).startswith(b'{"entries"')


def test_old_tuple_form_and_none_alpha_and_bf16_kept():
    up, down = _pair(1, dtype=torch.bfloat16)
    patches = {KEY_K: [_entry(("lora", (up, down, None, None, None, None)))]}
    table = build_table("m", patches, AdapterHashes())
    patch = table.doc["entries"][0]["patches"][0]
    assert patch["alpha"] is None
    bits = up.view(torch.int16).numpy().view(np.uint16)
    assert patch["up"] == tensor_hash(bits, "BF16")
    assert table.adapters[patch["up"]].dtype == np.uint16


def test_other_dtypes_become_float32():
    up, down = _pair(2, dtype=torch.float64)
    table = build_table(
        "m", {KEY_Q: [_entry(LoRAAdapter((up, down, 4, None, None, None)))]}, AdapterHashes()
    )
    patch = table.doc["entries"][0]["patches"][0]
    assert table.adapters[patch["up"]].dtype == np.float32 and patch["alpha"] == 4.0


def test_grouping_by_key_and_band_sorted():
    (u1, d1), (u2, d2), (u3, d3) = _pair(3), _pair(4), _pair(5)
    patches = {
        KEY_Q: [
            _entry(LoRAAdapter((u1, d1, 1.0, None, None, None)), offset=(0, 8, 8)),
            _entry(LoRAAdapter((u2, d2, 1.0, None, None, None))),
            _entry(LoRAAdapter((u3, d3, 1.0, None, None, None)), offset=(0, 0, 8)),
        ],
        KEY_K: [_entry(LoRAAdapter((u1, d1, 1.0, None, None, None)), 0.5)],
    }
    entries = build_table("m", patches, AdapterHashes()).doc["entries"]
    assert [(e["key"], e["band"]) for e in entries] == [
        (KEY_K, None),
        (KEY_Q, None),
        (KEY_Q, [0, 0, 8]),
        (KEY_Q, [0, 8, 8]),
    ]


def test_two_loras_on_one_key_share_an_entry():
    (u1, d1), (u2, d2) = _pair(6), _pair(7)
    patches = {
        KEY_Q: [
            _entry(LoRAAdapter((u1, d1, 1.0, None, None, None)), 1.0),
            _entry(LoRAAdapter((u2, d2, 2.0, None, None, None)), 0.3),
        ]
    }
    (entry,) = build_table("m", patches, AdapterHashes()).doc["entries"]
    assert [p["strength"] for p in entry["patches"]] == [1.0, 0.3]


def test_strength_zero_is_dropped_and_no_live_patch_means_no_table():
    up, down = _pair(8)
    patches = {
        KEY_Q: [_entry(LoRAAdapter((up, down, 1.0, None, None, None)), 0.0)],
        KEY_K: [_entry(("diff", (up,)), 0.0)],
    }
    table = build_table("m", patches, AdapterHashes())
    assert table.doc is None and table.adapters == {}


def test_strength_change_keeps_hashes_and_changes_id():
    up, down = _pair(9)
    hashes = AdapterHashes()
    lora = LoRAAdapter((up, down, 1.0, None, None, None))
    a = build_table("m", {KEY_Q: [_entry(lora, 1.0)]}, hashes)
    b = build_table("m", {KEY_Q: [_entry(lora, 0.5)]}, hashes)
    assert set(a.adapters) == set(b.adapters)
    assert table_id(a.doc) != table_id(b.doc)
    up.add_(1.0)  # an in-place change bumps the tensor version: hashed afresh
    assert hashes.hash(up)[0] != tensor_hash(_pair(9)[0].numpy())


@pytest.mark.parametrize(
    "value, entry_kw, words",
    [
        ([(torch.zeros(1), None)], {}, "merge list"),
        (("diff", (torch.zeros(16, 8),)), {}, "diff"),
        ((torch.zeros(16, 8),), {}, "diff"),
        (LoKrAdapter((None,) * 9), {}, "LoKr"),
        (("loha", (None,) * 6), {}, "LoHa"),
        (("glora", (None,) * 6), {}, "GLoRA"),
        (("oft", (None,) * 6), {}, "OFT"),
        (("boft", (None,) * 6), {}, "BOFT"),
        (LoRAAdapter((*_pair(10), 1.0, torch.zeros(4, 4, 1, 1), None, None)), {}, "mid"),
        (LoRAAdapter((*_pair(10), 1.0, None, torch.ones(16, 1), None)), {}, "DoRA"),
        (LoRAAdapter((*_pair(10), 1.0, None, None, [16, 8])), {}, "reshape"),
        (LoRAAdapter((*_pair(10), 1.0, None, None, None)), {"function": abs}, "function"),
        (
            LoRAAdapter((*_pair(10), 1.0, None, None, None)),
            {"strength_model": 0.5},
            "strength_model",
        ),
    ],
)
def test_refusals_by_name(value, entry_kw, words):
    with pytest.raises(GmlxError, match=words) as info:
        build_table("m", {KEY_Q: [_entry(value, **entry_kw)]}, AdapterHashes())
    assert str(info.value).startswith("gmlx:") and KEY_Q in str(info.value)


def test_hook_patches_are_refused():
    with pytest.raises(GmlxError, match="hook"):
        build_table("m", {}, AdapterHashes(), hook_patches={"ref": {KEY_Q: []}})


def test_inference_tensors_hash_without_a_version_counter():
    """ComfyUI loads LoRA files under torch.inference_mode; their tensors keep no version."""
    with torch.inference_mode():
        up = torch.randn(6, 2)
    hashes = AdapterHashes()
    digest, array = hashes.hash(up)
    assert digest == tensor_hash(up.numpy())
    assert hashes.hash(up)[0] == digest


def test_a_lora_patch_of_the_wrong_shape_is_named_with_its_key():
    """What the pack's patcher refuses at the LoRA loader (naming the file there): a patch whose
    matrices do not fit the weight (or the band of rows) it lands on."""
    from types import SimpleNamespace

    from gmlx_comfy.patches import misfit_patch

    def lora(up, down):
        return SimpleNamespace(name="lora", weights=(np.zeros(up), np.zeros(down), None, None))

    shapes = {"a.weight": (8, 16), "qkv.weight": (24, 16)}
    fits = {
        "a.weight": [(1.0, lora((8, 2), (2, 16)), 1.0, None, None)],
        "qkv.weight": [(1.0, lora((8, 2), (2, 16)), 1.0, (0, 8, 8), None)],  # its k rows
    }
    assert misfit_patch(fits, shapes) is None
    wrong = {"a.weight": [(1.0, lora((8, 2), (2, 32)), 1.0, None, None)]}
    assert misfit_patch(wrong, shapes) == (
        "its patch of a.weight is up [8, 2] × down [2, 32], where that weight is 8 × 16 (out × in)"
    )
    band = {"qkv.weight": [(1.0, lora((24, 2), (2, 16)), 1.0, (0, 8, 8), None)]}
    assert "up [24, 2]" in misfit_patch(band, shapes) and "8 × 16" in misfit_patch(band, shapes)


def test_the_stems_a_key_map_leaves_out_are_named():
    from gmlx_comfy.patches import half_matching_text, lora_key_map, unmatched_stems

    manifest = {"tensors": [{"name": KEY_Q[len("diffusion_model.") :], "shape": [16, 8]}]}
    key_map = lora_key_map(manifest)
    keys = [
        "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight",
        "lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight",
        "lora_unet_transformer_blocks_0_attn_to_q.alpha",
        "transformer.transformer_blocks.9.attn.to_q.lora_A.weight",
        "transformer.transformer_blocks.9.attn.to_q.lora_B.weight",
        "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
    ]
    unmatched, total = unmatched_stems(keys, key_map)
    assert total == 3
    assert unmatched == [
        "lora_te_text_model_encoder_layers_0_mlp_fc1",
        "transformer.transformer_blocks.9.attn.to_q",
    ]
    text = half_matching_text("the LoRA file 'x.safetensors'", "m", unmatched, total)
    assert text.startswith("gmlx: the LoRA file 'x.safetensors' patches 1 of its 3 layers in 'm'")
    assert unmatched_stems(keys[:3], key_map) == ([], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_adapter_hashes_are_memoised_per_tensor_and_go_with_it(monkeypatch, dtype):
    import gc

    from gmlx_comfy import patches

    computed = []

    def counted(array):
        computed.append(1)
        return tensor_hash(array)

    monkeypatch.setattr(patches, "tensor_hash", counted)
    hashes = AdapterHashes()
    up, _ = _pair(3, dtype=dtype)
    first, array = hashes.hash(up)
    again, _ = hashes.hash(up)
    assert first == again == tensor_hash(array) and len(computed) == 1 and len(hashes) == 1
    up.mul_(2)  # an in-place change is a new version: hashed again
    assert hashes.hash(up)[0] != first and len(computed) == 2
    del up, array
    gc.collect()
    assert len(hashes) == 0  # the memo kept neither the tensor nor a view of it


class Patcher:
    """A ModelPatcher as PatcherTables sees it: an object ComfyUI holds, then lets go of."""


def test_a_table_goes_with_the_last_patcher_that_names_it():
    """The tables of patchers ComfyUI let go of are forgotten at the next sync, but not one a
    live patcher still names (another uuid defined as the same table)."""
    import gc

    from gmlx_comfy.patches import PatcherTables

    tables, forgotten = PatcherTables(), []
    first, second, third = Patcher(), Patcher(), Patcher()
    tables.defined(first, "uuid-1", "table-a")
    tables.defined(second, "uuid-2", "table-a")
    tables.defined(third, "uuid-3", "table-b")
    tables.defined(Patcher(), "uuid-4", None)  # no live patch: nothing to forget
    del first, third
    gc.collect()
    tables.let_go(forgotten.append)
    assert forgotten == ["table-b"] and tables.ids == {"uuid-2": "table-a"}
    del second
    gc.collect()
    tables.let_go(forgotten.append)
    assert forgotten == ["table-b", "table-a"]


def test_a_table_stays_while_a_clone_of_its_patcher_samples():
    """ComfyUI's clones share their original's patches uuid: the clone that samples keeps the
    table when the patcher that defined it goes."""
    import gc

    from gmlx_comfy.patches import PatcherTables

    tables, forgotten = PatcherTables(), []
    first, clone = Patcher(), Patcher()
    tables.defined(first, "uuid-1", "table-a")
    tables.watch(clone, "uuid-1")  # the clone's sync found the uuid's table
    del first
    gc.collect()
    tables.let_go(forgotten.append)
    assert forgotten == [] and tables.ids == {"uuid-1": "table-a"}
    del clone
    gc.collect()
    tables.let_go(forgotten.append)
    assert forgotten == ["table-a"] and tables.ids == {}
