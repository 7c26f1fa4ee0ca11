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


def reference_attention(q, k, v, scale, causal=False, valid_keys=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    repeat = q.shape[1] // k.shape[1]  # grouped queries: head h reads key head h // repeat
    k, v = (np.repeat(a, repeat, axis=1) for a in (k, v))
    scores = q @ k.swapaxes(-1, -2) * scale
    if causal:
        rows, keys = np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None, :]
        seen = (keys <= rows) & (keys < (valid_keys or k.shape[2]))
        scores = np.where(seen, scores, -np.inf)
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


# (heads, key heads, rows, valid keys, score block bytes): a causal prompt in one block, in
# row blocks of one head (the last short), its padding masked, and grouped queries.
CAUSAL_CASES = {
    "one_block": (2, 2, 40, None, None),
    "row_blocks": (2, 2, 70, None, 32 * 70 * 4),
    "padded": (2, 2, 70, 23, 32 * 70 * 4),
    "grouped": (4, 2, 40, 17, None),
    "one_key": (2, 1, 9, 1, None),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CAUSAL_CASES)
def test_causal_attention_matches_float64(monkeypatch, case, mode):
    """Query i sees keys 0..i, and none from valid_keys on (a right-padded prompt, its padding
    rows too), as transformers masks them; grouped queries as MLX's SDPA takes them."""
    heads, key_heads, rows, valid_keys, block = CAUSAL_CASES[case]
    if block is not None:
        monkeypatch.setattr(cpu_ops, "SCORE_BLOCK_BYTES", block)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, heads, rows, 8)).astype(np.float32) * 3
    k, v = (rng.standard_normal((1, key_heads, rows, 8)).astype(np.float32) for _ in "kv")
    attention = MODES[mode](
        lambda q, k, v: cpu_ops.attention(q, k, v, 0.35, causal=True, valid_keys=valid_keys)
    )
    got = attention(mx.array(q), mx.array(k), mx.array(v))
    expected = reference_attention(q, k, v, 0.35, causal=True, valid_keys=valid_keys)
    assert got.shape == expected.shape
    assert rel_l2(got, expected) < 2e-6


def test_block_shape():
    budget = cpu_ops.SCORE_BLOCK_BYTES // 4  # floats
    assert cpu_ops._block_shape(32, 100, budget // 400) == (100, 4)
    assert cpu_ops._block_shape(32, 4096, budget // 256) == (256, 1)
    assert cpu_ops._block_shape(32, 4096, budget) == (32, 1)  # never under 32 rows


def test_use_cpu_ops_only_for_float32_on_cpu():
    assert cpu_ops.use_cpu_ops(mx.float32) == (mx.default_device() == mx.cpu)
    assert not cpu_ops.use_cpu_ops(mx.bfloat16)
