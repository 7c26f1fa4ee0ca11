"""Patch tables on the engine: refusals at build time, runs alternating tables, the bound on
the tables' prepared weights."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from gmlx_contract.hashing import tensor_hash
from gmlx_contract.lora_keys import linear_layers
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.families.qwen_image21.dit import linear_slots
from gmlx_server.engine.lora import TableWeights
from gmlx_server.service import CachedTensor, build_table

from tests.lora.forms import client_table, random_lora, write_form
from tests.lora.reference import engine_step, layer_shapes, make_table, plain_model

TO_Q = "diffusion_model.transformer_blocks.0.attn.to_q.weight"  # (32, 32) in the tiny DiT
MLP_OUT = "diffusion_model.transformer_blocks.1.img_mlp.out.weight"  # (32, 96)


def pair(out_dim: int, in_dim: int, rank: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    up = rng.standard_normal((out_dim, rank)).astype(np.float32)
    down = rng.standard_normal((rank, in_dim)).astype(np.float32)
    return up, down


def one_entry(key: str, up, down, band=None, **patch) -> tuple[dict, dict]:
    doc = {
        "entries": [
            {
                "key": key,
                "band": band,
                "patches": [{"up": tensor_hash(up), "down": tensor_hash(down), **patch}],
            }
        ]
    }
    return doc, {tensor_hash(up): up, tensor_hash(down): down}


@pytest.mark.parametrize(
    "key, shapes, band, patch, message",
    [
        ("diffusion_model.transformer_blocks.7.attn.to_q.weight", (32, 32), None, {}, "not a linear"),
        ("diffusion_model.txt_in.text_norm.weight", (64, 64), None, {}, "not a linear"),
        ("diffusion_model.pos_embed", (32, 32), None, {}, "not a linear"),
        ("diffusion_model.transformer_blocks.0.attn.to_q.bias", (32, 32), None, {}, "bias"),
        (TO_Q, (31, 32), None, {}, "do not fit"),
        (TO_Q, (32, 33), None, {}, "do not fit"),
        (MLP_OUT, (32, 32), None, {}, "do not fit"),
        (TO_Q, (8, 32), [0, 28, 8], {}, "runs past"),
        (MLP_OUT, (32, 8), [1, 90, 8], {}, "runs past"),
        (TO_Q, (8, 32), [1, 0, 8], {}, "do not fit"),
        (TO_Q, (32, 32), None, {"kind": "lokr"}, "kind"),
        (TO_Q, (32, 32), None, {"strength_model": 0.5}, "strength_model"),
        (TO_Q, (32, 32), None, {"mid": "0" * 64}, "unknown members"),
        (TO_Q, (32, 32), None, {"strength": "1"}, "finite number"),
        (TO_Q, (32, 32), None, {"alpha": float("nan")}, "finite number"),
        (TO_Q, (32, 32), None, {"alpha": 10**400}, "finite number"),
        (TO_Q, (32, 32), None, {"strength": -(10**400)}, "finite number"),
        (TO_Q, (32, 32), None, {"alpha": 1e308, "strength": 1e10}, "not finite"),
    ],
)  # fmt: skip
def test_refusals(engine, key, shapes, band, patch, message):
    up, down = pair(*shapes)
    doc, adapters = one_entry(key, up, down, band, **patch)
    with pytest.raises(ValueError, match=message):  # answered 400 by the route
        make_table(engine, doc, adapters)


def test_refusals_of_matrices(engine):
    up, down = pair(32, 32)
    doc, adapters = one_entry(TO_Q, up, down)
    cached = {h: CachedTensor(a, "F32") for h, a in adapters.items()}
    cached[tensor_hash(down)] = CachedTensor(down.astype(np.uint8), "U8")
    loaded = SimpleNamespace(model_id=engine.model_id, model=engine)
    with pytest.raises(ValueError, match="floating point"):
        build_table(loaded, "t", doc, cached)
    ranks = {tensor_hash(up): up, tensor_hash(down): down[:1]}
    doc, _ = one_entry(TO_Q, up, down)
    with pytest.raises(ValueError, match="rank"):
        make_table(engine, doc, ranks)


def test_engine_refusals_are_engine_input_errors(engine):
    up, down = pair(31, 32)
    doc, adapters = one_entry(TO_Q, up, down)
    with pytest.raises(EngineInputError, match=r"entries\[0\]"):
        make_table(engine, doc, adapters)


def test_a_matrix_of_more_dimensions_is_flattened_keeping_the_first(engine):
    """A conv-style (out, r, 1, 1) up matrix is the (out, r) matrix."""
    up, down = pair(32, 32, seed=3)
    flat, _ = one_entry(TO_Q, up, down)
    shaped, adapters = one_entry(TO_Q, up.reshape(32, 2, 1, 1), down)
    rng = np.random.default_rng(4)
    cond = rng.standard_normal((5, 64)).astype(np.float32)
    x = rng.standard_normal((16, 2, 2)).astype(np.float32)
    a = engine_step(
        engine, cond, x, 0.5, make_table(engine, flat, {**adapters, tensor_hash(up): up})
    )
    b = engine_step(engine, cond, x, 0.5, make_table(engine, shaped, adapters))
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- runs alternating tables


def euler_run(engine, table, cond, x, sigmas, run):
    """Euler steps over `sigmas` under a table, yielding x after each (a generator, so two runs
    advance alternately when zipped)."""
    for sigma, next_sigma in zip(sigmas[:-1], sigmas[1:], strict=True):
        x = x + (next_sigma - sigma) * engine_step(engine, cond, x, sigma, table, run=run)
        yield x


def test_interleaved_runs_with_different_tables_equal_their_single_runs(tiny_folder, engine):
    base = plain_model(tiny_folder[1])
    shapes, layers = layer_shapes(base), linear_layers(engine.manifest())
    tables = []
    for seed, strength in ((20, 1.0), (21, 0.6)):
        state = write_form(random_lora(shapes, seed=seed), "comfy")
        tables.append(
            make_table(engine, *client_table(engine.model_id, [(state, strength)], layers))
        )
    rng = np.random.default_rng(22)
    cond = rng.standard_normal((6, 64)).astype(np.float32)  # one conditioning for both runs
    x0 = rng.standard_normal((16, 4, 4)).astype(np.float32)
    sigmas = [1.0, 0.75, 0.5, 0.25, 0.0]

    alone = []
    for index, table in enumerate(tables):
        alone.append(list(euler_run(engine, table, cond, x0, sigmas, run=f"alone{index}")))
        engine.end_run(f"alone{index}")
    assert not np.allclose(alone[0][-1], alone[1][-1], atol=1e-3)

    first = euler_run(engine, tables[0], cond, x0, sigmas, run="r1")
    second = euler_run(engine, tables[1], cond, x0, sigmas, run="r2")
    for step, (x1, x2) in enumerate(zip(first, second, strict=True)):
        np.testing.assert_array_equal(x1, alone[0][step])
        np.testing.assert_array_equal(x2, alone[1][step])
    engine.end_run("r1")
    engine.end_run("r2")


# ---------------------------------------------------------------- the bound


def test_prepared_tables_are_bounded_and_rebuilt_equal(tiny_folder, engine):
    base = plain_model(tiny_folder[1])
    shapes, layers = layer_shapes(base), linear_layers(engine.manifest())
    dit = engine.dit
    tables = []
    for seed in (30, 31, 32):
        state = write_form(random_lora(shapes, seed=seed), "kohya")
        tables.append(make_table(engine, *client_table(engine.model_id, [(state, 1.0)], layers)))
    one_tree = TableWeights(dit.weights, linear_slots(dit.config), dit.dtype)
    one_tree.weights_for(tables[0])
    size = one_tree.held_bytes
    bounded = TableWeights(dit.weights, linear_slots(dit.config), dit.dtype, int(size * 2.5))
    for table in tables:
        bounded.check(table)
    assert len(bounded) == 2 and bounded.held_bytes <= size * 2.5
    rebuilt = bounded.weights_for(tables[0])  # dropped first, built again
    kept = one_tree.weights_for(tables[0])
    key = "qkv" + ".lora_up"
    np.testing.assert_array_equal(
        np.array(rebuilt["blocks"][0][key]), np.array(kept["blocks"][0][key])
    )
    # The plain weights are shared, never copied, by every table's tree.
    assert rebuilt["blocks"][0]["qkv"] is dit.weights["blocks"][0]["qkv"]
    assert bounded.weights_for(None) is dit.weights
    assert isinstance(rebuilt["blocks"][0][key], mx.array)
