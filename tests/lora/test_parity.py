"""LoRA tables on the MLX DiT against diffusers' transformer with peft adapters (float32)."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_contract.hashing import tensor_hash
from gmlx_contract.lora_keys import linear_layers

from tests.compare import rel_l2
from tests.families.qwen_image21.dit.reference import reference_row
from tests.lora.forms import FORMS, client_table, random_lora, write_form
from tests.lora.reference import (
    engine_step,
    layer_shapes,
    make_table,
    patched_by_hand,
    peft_model,
    plain_model,
)

TOLERANCE = 1e-4
# A test LoRA must move the output at least this much, so a LoRA path that did nothing fails.
MOVES = 0.05


@pytest.fixture(scope="module")
def setup(tiny_folder, engine):
    _, folder = tiny_folder
    base = plain_model(folder)
    return folder, base, layer_shapes(base), linear_layers(engine.manifest())


def inputs(engine, seed: int, text_len: int = 6, hw=(4, 4), with_ref: bool = False):
    """A conditioning (L, D), latents x (C, h, w) and, optionally, one reference in slot 2."""
    config = engine.dit.config
    rng = np.random.default_rng(seed)
    cond = rng.standard_normal((text_len, config.context_in_dim)).astype(np.float32)
    x = rng.standard_normal((config.in_channels, *hw)).astype(np.float32)
    refs = [rng.standard_normal((config.in_channels, 2, 4)).astype(np.float32)] if with_ref else []
    return cond, x, refs, [2] if with_ref else []


def both(engine, reference_model, table, cond, x, sigma, refs=(), slots=()):
    ours = engine_step(engine, cond, x, sigma, table, refs, slots)
    theirs = reference_row(reference_model, cond, x, sigma, list(refs), list(slots))
    return ours, theirs


@pytest.mark.parametrize("form", FORMS)
def test_one_lora_in_each_key_form(setup, engine, form):
    folder, base, shapes, layers = setup
    lora = random_lora(shapes, seed=1, alpha=None if form == "diffusers" else 8.0)
    doc, adapters = client_table(engine.model_id, [(write_form(lora, form), 1.0)], layers)
    table = make_table(engine, doc, adapters)
    cond, x, refs, slots = inputs(engine, seed=2, with_ref=True)
    ours, theirs = both(engine, peft_model(folder, [(lora, 1.0)]), table, cond, x, 0.7, refs, slots)
    assert rel_l2(ours, theirs) <= TOLERANCE
    assert rel_l2(theirs, reference_row(base, cond, x, 0.7, refs, slots)) > MOVES


def test_two_loras_stacked_at_different_strengths(setup, engine):
    folder, base, shapes, layers = setup
    first = random_lora(shapes, seed=3, alpha=4.0, rank=4)
    second = random_lora(shapes, seed=4, alpha=16.0, rank=8, layers=sorted(shapes)[::2])
    stack = [(first, 0.8), (second, -0.35)]
    files = [(write_form(first, "kohya"), 0.8), (write_form(second, "comfy"), -0.35)]
    doc, adapters = client_table(engine.model_id, files, layers)
    assert any(len(entry["patches"]) == 2 for entry in doc["entries"])  # really stacked
    table = make_table(engine, doc, adapters)
    reference = peft_model(folder, stack)
    for seed, sigma in ((5, 0.9), (6, 0.25)):
        cond, x, refs, slots = inputs(engine, seed=seed, text_len=5 + seed, with_ref=seed == 6)
        ours, theirs = both(engine, reference, table, cond, x, sigma, refs, slots)
        assert rel_l2(ours, theirs) <= TOLERANCE


def banded_doc(engine, rng):
    """Bands on a middle part of a fused weight (to_k rows), on the last rows of the gate (next
    to proj in the fused gate/up), on input columns, two patches on one band and a whole-weight
    patch beside a band of the same key. Returns (doc, adapters, the weight changes)."""
    specs = [
        ("transformer_blocks.0.attn.to_k", [0, 4, 12], [(2, 3.0, 0.9), (3, None, -0.6)]),
        ("transformer_blocks.0.attn.to_k", None, [(2, 2.0, 0.5)]),
        ("transformer_blocks.1.img_mlp.gate_layer", [0, 90, 6], [(2, None, 1.0)]),
        ("transformer_blocks.1.img_mlp.out", [1, 10, 40], [(4, 4.0, 1.0)]),
        ("txt_in.in_layer", [1, 0, 20], [(2, 2.0, 0.7)]),
    ]
    shapes = {name: engine_shape(engine, name) for name, _, _ in specs}
    entries, adapters, changes = [], {}, []
    for layer, band, patches in specs:
        out_dim, in_dim = shapes[layer]
        if band is not None and band[0] == 0:
            out_dim = band[2]
        elif band is not None:
            in_dim = band[2]
        table_patches = []
        for rank, alpha, strength in patches:
            down = (rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)).astype(np.float32)
            up = rng.standard_normal((out_dim, rank)).astype(np.float32)
            adapters[tensor_hash(up)], adapters[tensor_hash(down)] = up, down
            table_patches.append(
                {"up": tensor_hash(up), "down": tensor_hash(down), "alpha": alpha,
                 "strength": strength}
            )  # fmt: skip
            scale = 1.0 if alpha is None else alpha / rank
            changes.append(
                (layer, None if band is None else tuple(band), strength * scale * up @ down)
            )
        entries.append(
            {"key": f"diffusion_model.{layer}.weight", "band": band, "patches": table_patches}
        )
    return {"model": engine.model_id, "entries": entries}, adapters, changes


def engine_shape(engine, layer: str) -> tuple[int, int]:
    return engine.tables.slots[layer].layer_shape(engine.dit.weights)


def test_banded_patches(setup, engine):
    folder, base, _, _ = setup
    doc, adapters, changes = banded_doc(engine, np.random.default_rng(7))
    table = make_table(engine, doc, adapters)
    reference = patched_by_hand(folder, changes)
    cond, x, refs, slots = inputs(engine, seed=8, with_ref=True)
    ours, theirs = both(engine, reference, table, cond, x, 0.6, refs, slots)
    assert rel_l2(ours, theirs) <= TOLERANCE
    assert rel_l2(theirs, reference_row(base, cond, x, 0.6, refs, slots)) > MOVES


def test_strength_zero_equals_no_table(setup, engine):
    _, _, shapes, layers = setup
    lora = random_lora(shapes, seed=9)
    doc, adapters = client_table(engine.model_id, [(write_form(lora, "comfy"), 0.0)], layers)
    table = make_table(engine, doc, adapters)
    cond, x, refs, slots = inputs(engine, seed=10, with_ref=True)
    with_table = engine_step(engine, cond, x, 0.5, table, refs, slots)
    without = engine_step(engine, cond, x, 0.5, None, refs, slots)
    np.testing.assert_array_equal(with_table, without)


def test_key_spellings_name_the_same_layer(setup, engine):
    """`model.diffusion_model.`, `diffusion_model.` or no prefix, with or without `.weight`."""
    _, _, shapes, layers = setup
    state = write_form(random_lora(shapes, seed=11), "kohya")
    cond, x, _, _ = inputs(engine, seed=12)
    outs = []
    for key_of in (
        lambda layer: f"diffusion_model.{layer}.weight",
        lambda layer: f"model.diffusion_model.{layer}.weight",
        lambda layer: layer,
        lambda layer: f"diffusion_model.{layer}",
    ):
        doc, adapters = client_table(engine.model_id, [(state, 1.0)], layers, key_of=key_of)
        outs.append(engine_step(engine, cond, x, 0.4, make_table(engine, doc, adapters)))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_a_table_changes_the_prefix_keys_and_values(setup, engine):
    """The prefix state is keyed by the table (docs/contract.md §3.3): the same conditioning under a
    table and under none gives two states, whose K and V differ."""
    _, _, shapes, layers = setup
    doc, adapters = client_table(
        engine.model_id, [(write_form(random_lora(shapes, seed=13), "comfy"), 1.0)], layers
    )
    table = make_table(engine, doc, adapters)
    cond, x, _, _ = inputs(engine, seed=14)
    engine_step(engine, cond, x, 0.5, None)
    engine_step(engine, cond, x, 0.5, table)
    key = "wire:" + tensor_hash(cond)
    held = {k[4]: s for k, s in engine.prefix_cache._states.items() if k[0] == key}
    assert set(held) == {None, table.table_id}
    plain, patched = held[None], held[table.table_id]
    assert rel_l2(np.array(patched.keys[0]), np.array(plain.keys[0])) > MOVES
    assert rel_l2(np.array(patched.values[1]), np.array(plain.values[1])) > MOVES
