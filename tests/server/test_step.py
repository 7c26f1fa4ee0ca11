"""POST step: row semantics, dtypes, headers and every refusal in the contract's order
(docs/contract.md §2.11, 3.3)."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_contract import wire

from .linear_family import row_output

RNG = np.random.default_rng(11)


def f32(*shape):
    return RNG.standard_normal(shape, dtype=np.float32)


def step(server, x, timestep, rows, **fields):
    tensors = {"x": x, "timestep": timestep}
    tensors.update(fields.pop("tensors", {}))
    return server.post_container("step", tensors, {"rows": rows, **fields})


def out_of(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    c = wire.read_container(r.content)
    assert list(c.tensors) == ["out"] and c.dtypes["out"] == "F32" and c.fields == {}
    return c.tensors["out"]


def test_each_row_is_computed_on_its_own(live):
    cond_a, cond_b = f32(1, 7, 8), f32(5, 8)  # (1, L, D) and (L, D), different lengths
    ref = f32(1, 4, 2, 2)
    mask = np.array([[1, 1, 1, 0, 0, 0, 0]], np.float32)
    ha, hb, hr, hm = (live.put_tensor(a) for a in (cond_a, cond_b, ref, mask))
    x = f32(4, 4, 3, 2)
    t = np.array([0.9, 0.5, 0.25, 0.0], np.float32)
    rows = [
        {"cond": ha},
        {"cond": hb, "num_tokens": 2},
        {"cond": ha, "attention_mask": hm, "ref_latents": [hr], "image_slots": [1, 5]},
        {"cond": hb, "ref_latents": [hr, hr], "image_slots": [3]},
    ]
    out = out_of(step(live, x, t, rows))
    assert out.shape == x.shape
    expected = [
        row_output(x[0], 0.9, cond_a[0]),
        row_output(x[1], 0.5, cond_b[:2]),
        row_output(x[2], 0.25, cond_a[0, :3], [ref[0]], [1]),  # the extra slot is dropped
        row_output(x[3], 0.0, cond_b, [ref[0], ref[0]], [3]),
    ]
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(out[i], want, err_msg=f"row {i}")


@pytest.mark.parametrize("shape", [(3,), (1,), ()])
def test_timestep_forms(live, shape):
    cond = f32(1, 3, 8)
    h = live.put_tensor(cond)
    x = f32(3, 4, 1, 1)
    t = np.array([0.1, 0.2, 0.3], np.float32) if shape == (3,) else np.full(shape, 0.5, np.float32)
    out = out_of(step(live, x, t, [{"cond": h}] * 3))
    times = np.broadcast_to(t.reshape(-1), (3,))
    for i in range(3):
        np.testing.assert_array_equal(out[i], row_output(x[i], float(times[i]), cond[0]))


def test_dtypes_are_read_as_values(live):
    cond = f32(1, 4, 8)
    cond_bf16 = wire.f32_to_bf16_bits(cond)
    h = live.put_tensor(cond_bf16)
    x = f32(1, 4, 2, 2).astype(np.float16)
    out = out_of(step(live, x, np.array([0.5], np.float32), [{"cond": h}]))
    want = row_output(x[0].astype(np.float32), 0.5, wire.bf16_bits_to_f32(cond_bf16)[0])
    np.testing.assert_array_equal(out[0], want)


def test_headers_and_prefix_cache(fresh):
    cond = fresh.put_tensor(f32(1, 3, 8))
    x, t = f32(1, 4, 2, 2), np.zeros(1, np.float32)
    r1 = step(fresh, x, t, [{"cond": cond}])
    r2 = step(fresh, x, t, [{"cond": cond}])
    r3 = step(fresh, x, t, [{"cond": cond, "prefix_cache": False}])
    assert [r.headers["X-Gmlx-Prefix-Cache"] for r in (r1, r2, r3)] == ["miss", "hit", "off"]
    assert r1.headers["X-Gmlx-Forward-Ms"] == "0.25"
    server_ms = r1.headers["X-Gmlx-Server-Ms"]
    assert float(server_ms) >= 0.25 and len(server_ms.split(".")[1]) == 2


def test_truncated_cond_key(fresh):
    cond = f32(1, 4, 8)
    h = fresh.put_tensor(cond)
    x, t = f32(1, 4, 1, 1), np.zeros(1, np.float32)
    out_of(step(fresh, x, t, [{"cond": h, "num_tokens": 4}]))
    out_of(step(fresh, x, t, [{"cond": h, "num_tokens": 2}]))
    keys = {key[0] for key in fresh.model().seen_keys}
    assert keys == {f"wire:{h}", f"wire:{h}:2"}


# ---------------------------------------------------------------- refusals, in order

X = np.zeros((1, 4, 2, 2), np.float32)
T = np.zeros(1, np.float32)


def test_order_run_before_shapes(live):
    # 2 before 3: an unknown run is 404 even when x is missing
    r = live.post_container("step", {"timestep": T}, {"rows": [{"cond": "a"}], "run": "f" * 16})
    assert r.status_code == 404


@pytest.mark.parametrize(
    "tensors, fields, status",
    [
        ({"timestep": T}, {"rows": [{"cond": "a"}]}, 400),  # no x
        ({"x": X}, {"rows": [{"cond": "a"}]}, 400),  # no timestep
        ({"x": X, "timestep": T}, {}, 400),  # no rows
        ({"x": X, "timestep": T}, {"rows": []}, 400),
        ({"x": X, "timestep": T}, {"rows": {"cond": "a"}}, 400),
        ({"x": X[0], "timestep": T}, {"rows": [{"cond": "a"}]}, 400),  # 3-D
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}] * 2}, 400),  # B != rows
        (
            {"x": np.zeros((17, 4, 1, 1), np.float32), "timestep": T},
            {"rows": [{"cond": "a"}] * 17},
            413,
        ),
        ({"x": X, "timestep": np.zeros(2, np.float32)}, {"rows": [{"cond": "a"}]}, 400),
        ({"x": X, "timestep": np.zeros((1, 1), np.float32)}, {"rows": [{"cond": "a"}]}, 400),
        ({"x": X, "timestep": T}, {"rows": ["a"]}, 400),
        ({"x": X, "timestep": T}, {"rows": [{"cond": 5}]}, 400),
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a", "ref_latents": "b"}]}, 400),
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a", "attention_mask": 3}]}, 400),
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "run": 7}, 400),
        ({"x": np.zeros((1, 4, 0, 8), np.float32), "timestep": T}, {"rows": [{"cond": "a"}]}, 400),
        # this server: values no step can take
        ({"x": X, "timestep": np.float32([np.nan])}, {"rows": [{"cond": "a"}]}, 400),
        ({"x": X, "timestep": np.float32([np.inf])}, {"rows": [{"cond": "a"}]}, 400),
        (
            {"x": np.full((1, 4, 2, 2), np.nan, np.float32), "timestep": T},
            {"rows": [{"cond": "a"}]},
            400,
        ),
        # 4: the model
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "model": "ghost"}, 404),
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "model": "stranger"}, 400),
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "model": "broken"}, 400),
        # 5: pixels (latent stride 8): 2400 x 2400 and a 4160-pixel side
        (
            {"x": np.zeros((1, 4, 300, 300), np.float32), "timestep": T},
            {"rows": [{"cond": "a"}]},
            413,
        ),
        (
            {"x": np.zeros((1, 4, 1, 520), np.float32), "timestep": T},
            {"rows": [{"cond": "a"}]},
            413,
        ),
        # 6: over 10 references
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a", "ref_latents": ["b"] * 11}]}, 400),
        # 7: convention
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "convention": "torch"}, 400),
        # 8: ref_cache and skip on a family without them
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "ref_cache": True}, 400),
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "ref_cache": "yes"}, 400),
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "skip": [1]}, 400),
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a"}], "skip": "1"}, 400),
        # 9: missing, even with a broken num_tokens (checked at 11)
        ({"x": X, "timestep": T}, {"rows": [{"cond": "a", "num_tokens": "x"}]}, 409),
    ],
)
def test_refusals(live, tensors, fields, status):
    r = live.post_container("step", tensors, fields)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"], str)


def test_missing_lists_every_hash_and_the_table_sorted_once(live):
    held = live.put_tensor(f32(1, 2, 8))
    ref_missing, cond_missing, mask_missing, tid = "c" * 64, "b" * 64, "a" * 64, "d" * 64
    rows = [
        {"cond": cond_missing, "ref_latents": [ref_missing, held]},
        {"cond": held, "attention_mask": mask_missing, "ref_latents": [ref_missing]},
        {"cond": cond_missing},
    ]
    r = step(live, np.zeros((3, 4, 1, 1), np.float32), T, rows, patch_table=tid)
    assert r.status_code == 409
    assert r.json()["missing"] == [mask_missing, cond_missing, ref_missing, tid]


@pytest.mark.parametrize(
    "row_extra, cond_shape",
    [
        ({"num_tokens": 0}, (1, 4, 8)),
        ({"num_tokens": 5}, (1, 4, 8)),
        ({"num_tokens": True}, (1, 4, 8)),
        ({"image_slots": [2, 1]}, (1, 4, 8)),
        ({"image_slots": [9]}, (1, 4, 8)),
        ({"image_slots": "0"}, (1, 4, 8)),
        ({"prefix_cache": "no"}, (1, 4, 8)),
        ({}, (2, 4, 8)),  # cond batch of 2
        ({}, (32,)),  # cond 1-D
    ],
)
def test_row_refusals_at_step_11(live, row_extra, cond_shape):
    cond = live.put_tensor(np.ones(cond_shape, np.float32))
    ref = live.put_tensor(np.ones((1, 4, 2, 2), np.float32))
    row = {"cond": cond, "ref_latents": [ref, ref], **row_extra}
    r = step(live, X, T, [row])
    assert r.status_code == 400, r.text


@pytest.mark.parametrize(
    "mask, num_tokens",
    [
        ([1, 0, 1, 0], None),  # not a prefix
        ([0, 0, 0, 0], None),  # keeps nothing
        ([1, 1, 0, 0], 3),  # disagrees with num_tokens
        ([1, 1, 1, 1, 1], None),  # longer than the cond
    ],
)
def test_mask_refusals(live, mask, num_tokens):
    cond = live.put_tensor(np.ones((1, 4, 8), np.float32))
    m = live.put_tensor(np.array([mask], np.float32))
    row = {"cond": cond, "attention_mask": m}
    if num_tokens is not None:
        row["num_tokens"] = num_tokens
    assert step(live, X, T, [row]).status_code == 400


def test_mask_that_agrees_with_num_tokens(live):
    cond = f32(1, 4, 8)
    h = live.put_tensor(cond)
    m = live.put_tensor(np.array([[1, 1, 0, 0]], np.uint8))
    out = out_of(step(live, X, T, [{"cond": h, "attention_mask": m, "num_tokens": 2}]))
    np.testing.assert_array_equal(out[0], row_output(X[0], 0.0, cond[0, :2]))


def test_bad_reference_latents(live):
    cond = live.put_tensor(np.ones((1, 4, 8), np.float32))
    flat_ref = live.put_tensor(np.ones((4, 4), np.float32))
    assert step(live, X, T, [{"cond": cond, "ref_latents": [flat_ref]}]).status_code == 400
    batch_of_two = live.put_tensor(np.ones((2, 4, 2, 2), np.float32))
    assert step(live, X, T, [{"cond": cond, "ref_latents": [batch_of_two]}]).status_code == 400
