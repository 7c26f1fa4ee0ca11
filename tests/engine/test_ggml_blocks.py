"""GGUF weights held as their file's blocks (engine/ggml_blocks.py): every type decodes to what
`gguf.quants.dequantize` gives, bit for bit; a fused weight of mixed types, its rows and
columns cut as a rank's shard, the layout through a family's sanitize, and the module layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_server.engine import ggml_blocks
from gmlx_server.engine.ggml_blocks import (
    LAYOUT,
    BlockLayout,
    Blocks,
    decode,
    hold_blocks,
    sanitize_blocks,
    take_columns,
    take_rows,
)
from gmlx_server.engine.gguf import READABLE
from gmlx_server.engine.quantize import linear, logical_shape

from tests.engine.gguf_files import encoded, reference

SHAPE = (6, 512)  # two K-quant super-blocks per row


def tensor(kind: T, shape=SHAPE, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(bytes (rows, bytes per row), gguf's float32 weights) of a random tensor of `kind`."""
    rng = np.random.default_rng(seed + int(kind))
    data = encoded(kind, rng.standard_normal(shape).astype(np.float32) * 0.3, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(shape[0], -1)
    return raw, reference(kind, data).reshape(shape)


def blocks(*parts: tuple[T, np.ndarray]) -> Blocks:
    cols = SHAPE[1]
    layout = BlockLayout(cols, ggml_blocks.merged((kind, raw.shape[0]) for kind, raw in parts))
    return Blocks(mx.array(np.concatenate([raw.reshape(-1) for _, raw in parts])), layout)


@pytest.mark.parametrize("kind", READABLE, ids=lambda kind: kind.name)
def test_every_type_decodes_bit_for_bit(kind):
    raw, expected = tensor(kind)
    held = blocks((kind, raw))
    assert held.layout.nbytes == raw.nbytes  # no bigger than the file
    got = np.array(decode(held.data, held.layout))
    np.testing.assert_array_equal(got, expected)
    assert np.abs(expected).max() > 0.1  # the blocks hold weights, not zeros


def test_a_fused_weight_of_mixed_types_is_each_part_exactly():
    parts = [tensor(T.Q4_K, seed=1), tensor(T.Q6_K, seed=2), tensor(T.F16, seed=3)]
    held = blocks((T.Q4_K, parts[0][0]), (T.Q6_K, parts[1][0]), (T.F16, parts[2][0]))
    expected = np.concatenate([weights for _, weights in parts])
    assert held.layout.types == (T.Q4_K, T.Q6_K, T.F16)
    np.testing.assert_array_equal(np.array(decode(held.data, held.layout)), expected)
    x = mx.array(np.random.default_rng(4).standard_normal((20, SHAPE[1])).astype(np.float32))
    node = {"w": held.data, "w" + LAYOUT: held.layout.constants()}
    assert logical_shape(node, "w") == expected.shape
    np.testing.assert_array_equal(
        np.array(linear(node, "w", x)), np.array(x @ mx.array(expected).T)
    )


def test_a_shards_rows_and_columns_are_the_weights():
    (q4, w4), (q6, w6) = tensor(T.Q4_K, seed=5), tensor(T.Q6_K, seed=6)
    held = blocks((T.Q4_K, q4), (T.Q6_K, q6))
    whole = np.concatenate([w4, w6])
    rows = np.array([1, 2, 7, 11])
    data, layout = take_rows(held.data, held.layout, rows)
    assert layout.runs == ((T.Q4_K, 2), (T.Q6_K, 2))
    np.testing.assert_array_equal(np.array(decode(data, layout)), whole[rows])
    data, layout = take_columns(held.data, held.layout, 256, 512)
    np.testing.assert_array_equal(np.array(decode(data, layout)), whole[:, 256:])
    assert take_columns(held.data, held.layout, 0, 128) is None  # not on whole super-blocks


def test_the_layout_follows_a_sanitize_that_fuses_rows():
    (a, wa), (b, wb) = tensor(T.Q8_0, seed=7), tensor(T.Q3_K, seed=8)
    bias = mx.ones((SHAPE[0] * 2,))
    files = {"a": blocks((T.Q8_0, a)), "b": blocks((T.Q3_K, b)), "bias": bias}

    def sanitize(f):
        return {"blocks": [{"ab": mx.concatenate([f["a"], f["b"]]), "bias": f["bias"]}]}

    tree = sanitize_blocks(files, sanitize)
    node = tree["blocks"][0]
    layout = BlockLayout.of(node["ab" + LAYOUT])
    assert layout.runs == ((T.Q8_0, SHAPE[0]), (T.Q3_K, SHAPE[0])) and "bias" + LAYOUT not in node
    np.testing.assert_array_equal(np.array(decode(node["ab"], layout)), np.concatenate([wa, wb]))


def test_module_layers_hold_the_blocks():
    (w, expected), (table, rows) = tensor(T.Q5_K, seed=9), tensor(T.Q2_K, seed=10)

    class Module(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(SHAPE[0], SHAPE[1])
            self.proj = nn.Linear(SHAPE[1], SHAPE[0])

    module = Module()
    bias = mx.arange(SHAPE[0], dtype=mx.float32)
    weights = {
        "embed.weight": blocks((T.Q2_K, table)),
        "proj.weight": blocks((T.Q5_K, w)),
        "proj.bias": bias,
    }
    hold_blocks(module, weights)
    module.load_weights(list(weights.items()), strict=True)
    ids = mx.array([[3, 0], [5, 3]])
    np.testing.assert_array_equal(np.array(module.embed(ids)), rows[np.array(ids)])
    x = mx.array(rows[:4])
    np.testing.assert_array_equal(
        np.array(module.proj(x)), np.array(x @ mx.array(expected).T + bias)
    )
    held = sum(v.nbytes for _, v in nn.utils.tree_flatten(module.parameters()))
    assert held == table.nbytes + w.nbytes + bias.nbytes


KQUANT_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


@pytest.mark.parametrize("kind", KQUANT_TYPES, ids=lambda kind: kind.name)
def test_mlx_kquant_decodes_and_multiplies_as_the_blocks(kind):
    """Where the `kquant` extra is importable (macOS's wheels, or its sdist built on Linux),
    its codecs against ours: the same weights, and its quantized matmul (the path a Metal
    server takes) within its bf16 accumulation of ours."""
    kq = pytest.importorskip("mlx_kquant")
    raw, expected = tensor(kind)
    held = blocks((kind, raw))
    codec = kind.name.lower()
    placeholder = mx.zeros((1,), mx.uint8)
    theirs = kq.dequantize(mx.array(raw), placeholder, codec, dtype=mx.float32)
    np.testing.assert_array_equal(np.array(theirs), expected)
    x = mx.array(np.random.default_rng(14).standard_normal((20, SHAPE[1])).astype(np.float32))
    got = np.array(ggml_blocks.kquant_matmul(x, held.data, held.layout), np.float64)
    ours = np.array(linear({"w": held.data, "w" + LAYOUT: held.layout.constants()}, "w", x))
    assert np.linalg.norm(got - ours) / np.linalg.norm(ours) <= 1e-2
