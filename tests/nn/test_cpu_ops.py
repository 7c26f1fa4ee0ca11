"""The CPU rewrites of exp2, sigmoid and attention (server/engine/nn/cpu_ops.py) against float64
numpy, eager and under mx.compile, and the DiT with them against the DiT without them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.nn import cpu_ops

from tests.compare import rel_l2

MODES = {"eager": lambda f: f, "compiled": mx.compile}


@pytest.mark.parametrize("mode", MODES)
def test_exp2_matches_float64_and_underflows_to_zero(mode):
    exp2 = MODES[mode](cpu_ops.exp2_nonpositive)
    x = np.concatenate(
        [
            -np.random.default_rng(0).uniform(0, 126, 20000),
            [0.0, -0.5, -1.5, -126.0, -126.4],
        ]
    ).astype(np.float32)
    got = np.array(exp2(mx.array(x)), np.float64)
    expected = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got - expected) / expected) < 3e-7
    assert got[-5] == 1.0  # exp2(0) exactly
    tiny = np.array([-127.6, -150.0, -1e4, -3e9, -1e30], np.float32)
    assert np.all(np.array(exp2(mx.array(tiny))) == 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_sigmoid_matches_float64_without_overflow(mode):
    sigmoid = MODES[mode](cpu_ops.sigmoid)
    x = np.random.default_rng(1).uniform(-60, 60, 20000).astype(np.float32)
    x[:5] = [0.0, 1e-30, -1e-30, 40.0, -40.0]
    got = np.array(sigmoid(mx.array(x)), np.float64)
    expected = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    assert np.max(np.abs(got - expected) / expected) < 5e-6
    assert got[0] == 0.5
    extremes = np.array(sigmoid(mx.array(np.array([1e30, -1e30, 1e38, -1e38], np.float32))))
    np.testing.assert_array_equal(extremes, [1.0, 0.0, 1.0, 0.0])


def reference_attention(q, k, v, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = q @ k.swapaxes(-1, -2) * scale
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


# (batch, heads, query rows, keys, head dim, score block bytes): one block; whole heads grouped;
# one head split into row blocks with a short last block.
ATTENTION_CASES = {
    "one_block": (1, 3, 20, 33, 16, None),
    "head_groups": (1, 5, 20, 33, 8, 2 * 20 * 33 * 4),
    "row_blocks": (2, 2, 70, 90, 8, 32 * 90 * 4),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_float64(monkeypatch, case, mode):
    batch, heads, rows, keys, dim, block = ATTENTION_CASES[case]
    if block is not None:
        monkeypatch.setattr(cpu_ops, "SCORE_BLOCK_BYTES", block)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((batch, heads, rows, dim)).astype(np.float32) * 3
    k = rng.standard_normal((batch, heads, keys, dim)).astype(np.float32) * 3
    v = rng.standard_normal((batch, heads, keys, dim)).astype(np.float32)
    scale = dim**-0.5
    attention = MODES[mode](lambda q, k, v: cpu_ops.attention(q, k, v, scale))
    got = attention(mx.array(q), mx.array(k), mx.array(v))
    assert got.shape == (batch, heads, rows, dim)
    assert rel_l2(got, reference_attention(q, k, v, scale)) < 2e-6


def test_block_shape():
    budget = cpu_ops.SCORE_BLOCK_BYTES // 4  # floats
    assert cpu_ops._block_shape(32, 100, budget // 400) == (100, 4)
    assert cpu_ops._block_shape(32, 4096, budget // 256) == (256, 1)
    assert cpu_ops._block_shape(32, 4096, budget) == (32, 1)  # never under 32 rows


def test_use_cpu_ops_only_for_float32_on_cpu():
    assert cpu_ops.use_cpu_ops(mx.float32) == (mx.default_device() == mx.cpu)
    assert not cpu_ops.use_cpu_ops(mx.bfloat16)
