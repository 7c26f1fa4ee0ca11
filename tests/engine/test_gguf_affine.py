"""MLX's affine form of GGUF's types (engine/gguf_affine.py, the `affine` setting): the exact
types dequantize to what `gguf.quants.dequantize` gives, bit for bit in float32; the others
within their measured bound (docs/benchmarks.md, "GGUF types")."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_server.engine import gguf_affine
from gmlx_server.engine.gguf_affine import EXACT, GROUP_SIZE, NEAREST, pack, unpack

from tests.engine.gguf_files import random_blocks

SHAPE = (24, 512)  # two K-quant super-blocks per row; more rows than ROWS_PER_CHUNK below
# The added error of NEAREST's conversions on random blocks (relative L2 against gguf's
# dequantized weights), with a margin over docs/benchmarks.md's figures.
NEAREST_BOUND = {T.Q6_K: 0.007, T.Q3_K: 0.05, T.Q2_K: 0.065}


def mlx_dequantized(item) -> np.ndarray:
    packed, scales, biases = item.packed()
    return np.array(mx.dequantize(packed, scales, biases, group_size=GROUP_SIZE, bits=item.bits))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(gguf_affine, "ROWS_PER_CHUNK", 10)  # chunks that do not divide the rows


@pytest.mark.parametrize("kind", list(EXACT), ids=lambda kind: kind.name)
def test_exact_types_dequantize_bit_for_bit(kind):
    data = random_blocks(kind, SHAPE, np.random.default_rng(int(kind)))
    expected = gguf.quants.dequantize(data, kind)
    item = gguf_affine.affine(kind, data, *SHAPE)
    assert item.bits == EXACT[kind] and item.scales.dtype == np.float32
    np.testing.assert_array_equal(mlx_dequantized(item), expected)
    # widened to 8 bits (a fused weight whose parts differ) it is still exact
    packed, scales, biases = item.packed(8)
    wide = mx.dequantize(packed, scales, biases, group_size=GROUP_SIZE, bits=8)
    np.testing.assert_array_equal(np.array(wide), expected)
    assert np.abs(expected).max() > 0.1  # the blocks hold weights, not zeros


@pytest.mark.parametrize("kind", list(NEAREST), ids=lambda kind: kind.name)
def test_nearest_types_stay_within_their_measured_error(kind):
    data = random_blocks(kind, SHAPE, np.random.default_rng(int(kind)))
    expected = gguf.quants.dequantize(data, kind)
    item = gguf_affine.affine(kind, data, *SHAPE)
    assert item.bits == NEAREST[kind]
    error = np.linalg.norm(mlx_dequantized(item) - expected) / np.linalg.norm(expected)
    assert 0 < error <= NEAREST_BOUND[kind]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, (3, 64), dtype=np.uint8)
    np.testing.assert_array_equal(unpack(pack(q, bits), bits), q)
    ones = mx.ones((3, 2))
    levels = mx.dequantize(mx.array(pack(q, bits)), ones, 0 * ones, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(levels), q)
