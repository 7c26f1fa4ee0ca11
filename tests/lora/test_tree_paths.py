"""Patch tables on a weight tree of any shape: two kinds of blocks under their own keys (no
`blocks`), a node nested in a block, fused and unfused projections, a weight at the root."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.lora import LinearSlot, TableWeights, pair_bytes, project
from gmlx_server.service import LoraPatch, PatchEntry, PatchTable

WIDTH = 8
PARTS = ("to_q", "to_k", "to_v")


def weight_tree(seed: int = 0) -> dict:
    """double[i].{img,txt}.qkv fused (3 x WIDTH rows), double[i].out and single[i].proj unfused,
    single[i].qkv fused, `embed` at the root."""
    rng = np.random.default_rng(seed)

    def w(rows: int, cols: int = WIDTH) -> mx.array:
        return mx.array(rng.standard_normal((rows, cols)).astype(np.float32))

    return {
        "embed": w(WIDTH, 6),
        "double": [
            {"img": {"qkv": w(3 * WIDTH)}, "txt": {"qkv": w(3 * WIDTH)}, "out": w(WIDTH)}
            for _ in range(2)
        ],
        "single": [{"qkv": w(3 * WIDTH), "proj": w(WIDTH, 2 * WIDTH)} for _ in range(3)],
    }


def slots() -> dict[str, LinearSlot]:
    found = {"embed": LinearSlot("embed")}
    for i in range(2):
        for stream in ("img", "txt"):
            for part, name in enumerate(PARTS):
                found[f"double_blocks.{i}.{stream}_attn.{name}"] = LinearSlot(
                    "qkv", ("double", i, stream), part, 3
                )
        found[f"double_blocks.{i}.out"] = LinearSlot("out", ("double", i))
    for i in range(3):
        for part, name in enumerate(PARTS):
            found[f"single_blocks.{i}.attn.{name}"] = LinearSlot("qkv", ("single", i), part, 3)
        found[f"single_blocks.{i}.proj"] = LinearSlot("proj", ("single", i))
    return found


def patch(rows: int, cols: int, seed: int, strength: float = 0.7) -> LoraPatch:
    rng = np.random.default_rng(seed)
    up = rng.standard_normal((rows, 2)).astype(np.float32)
    down = rng.standard_normal((2, cols)).astype(np.float32)
    return LoraPatch(up=up, down=down, scale=0.5, strength=strength)


def table(*entries: tuple[str, tuple | None, LoraPatch]) -> PatchTable:
    built = tuple(
        PatchEntry(key=f"{layer}.weight", layer=layer, band=band, patches=(p,))
        for layer, band, p in entries
    )
    return PatchTable(table_id="t" * 64, model_id="m", entries=built)


def expected_weight(tree: dict, layer: str, entries) -> np.ndarray:
    """The fused weight of `layer`'s slot with every entry on it merged in numpy (W + s B A)."""
    slot = slots()[layer]
    merged = np.array(slot.node(tree)[slot.key])
    rows = merged.shape[0] // slot.parts
    for name, band, p in entries:
        other = slots()[name]
        if other.fused != slot.fused:
            continue
        delta = (p.up @ p.down) * np.float32(p.strength * p.scale)
        top, left = other.part * rows, 0
        if band is not None:
            dim, start, _ = band
            top, left = (top + start, 0) if dim == 0 else (top, start)
        merged[top : top + delta.shape[0], left : left + delta.shape[1]] += delta
    return merged


ENTRIES = (
    ("embed", None, patch(WIDTH, 6, 1)),
    ("double_blocks.1.txt_attn.to_k", None, patch(WIDTH, WIDTH, 2)),  # fused, middle part
    ("double_blocks.1.txt_attn.to_v", (0, 2, 4), patch(4, WIDTH, 3)),  # a band of rows
    ("double_blocks.0.out", None, patch(WIDTH, WIDTH, 4)),  # unfused, in a double block
    ("single_blocks.2.attn.to_q", None, patch(WIDTH, WIDTH, 5)),
    ("single_blocks.2.proj", (1, 4, 8), patch(WIDTH, 8, 6)),  # a band of columns
)


def test_each_patched_projection_equals_its_merged_weight_wherever_it_sits():
    tree = weight_tree()
    tables = TableWeights(tree, slots(), mx.float32)
    patched = tables.weights_for(table(*ENTRIES))
    x = np.random.default_rng(9).standard_normal((3, 16)).astype(np.float32)
    for layer, _, _ in ENTRIES:
        slot = slots()[layer]
        cols = slot.node(tree)[slot.key].shape[1]
        got = np.array(project(slot.node(patched), slot.key, mx.array(x[:, :cols])))
        want = x[:, :cols] @ expected_weight(tree, layer, ENTRIES).T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_unpatched_nodes_are_shared_and_the_plain_tree_is_untouched():
    tree = weight_tree()
    patched = TableWeights(tree, slots(), mx.float32).weights_for(table(*ENTRIES))
    assert patched["double"][1]["img"] is tree["double"][1]["img"]  # not patched: shared
    assert patched["single"][0] is tree["single"][0]
    assert patched["single"][2]["qkv"] is tree["single"][2]["qkv"]  # the plain weight itself
    assert patched["double"][1]["txt"] is not tree["double"][1]["txt"]
    assert not any(key.endswith(".lora_down") for key in tree["double"][1]["txt"])
    one_pair = 4 * (2 * 6 + WIDTH * 2)  # the root's: down (2, 6) and up (WIDTH, 2), float32
    assert pair_bytes(patched) > one_pair
    assert pair_bytes(TableWeights(tree, slots(), mx.float32).weights_for(table(ENTRIES[0]))) == (
        one_pair
    )
    assert pair_bytes(tree) == 0


def test_two_patches_on_one_fused_weight_become_one_pair():
    tree = weight_tree()
    patched = TableWeights(tree, slots(), mx.float32).weights_for(table(*ENTRIES))
    node = patched["double"][1]["txt"]
    assert node["qkv.lora_down"].shape == (4, WIDTH)  # two rank-2 patches, concatenated
    assert node["qkv.lora_up"].shape == (3 * WIDTH, 4)


def test_a_key_that_is_no_linear_layer_of_the_tree_is_refused_naming_one_that_is():
    tables = TableWeights(weight_tree(), slots(), mx.float32)
    with pytest.raises(EngineInputError, match=r"not a linear layer.*double_blocks\.0\.img_attn"):
        tables.check(table(("blocks.0.attn.to_q", None, patch(WIDTH, WIDTH, 7))))
