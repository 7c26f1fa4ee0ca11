"""nn.attention: the CPU backend's query chunks outside float32 (MLX's unfused SDPA there), and
the encoders' attention through cpu_ops in float32."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.nn import attention as module
from gmlx_server.memory import allocation_bound

from tests.compare import rel_l2


def qkv(rows: int, keys: int, dtype):
    rng = np.random.default_rng(0)
    q, k, v = (
        mx.array(rng.standard_normal((1, 4, n, 64), dtype=np.float32)).astype(dtype)
        for n in (rows, keys, keys)
    )
    return q, k, v


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU backend's path")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_query_chunks_equal_the_whole_attention(monkeypatch, dtype):
    q, k, v = qkv(300, 170, dtype)
    whole = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    monkeypatch.setattr(module, "QUERY_CHUNK", 64)  # 300 rows: four whole chunks and a part
    chunked = module.attention(q, k, v, 0.125, blocked=False)
    assert chunked.shape == whole.shape and chunked.dtype == dtype
    # each row's softmax is the same computation over the same keys: equal to the bit
    np.testing.assert_array_equal(
        np.array(chunked.astype(mx.float32)), np.array(whole.astype(mx.float32))
    )


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU backend's path")
def test_query_chunks_hold_one_chunk_of_scores_at_a_time(monkeypatch):
    q, k, v = qkv(2048, 2048, mx.bfloat16)
    mx.eval(q, k, v)
    scores = 4 * 2048 * 2048 * 2  # the whole score matrix in bfloat16

    def live(chunk: int) -> int:
        """MLX's peak with nothing queued ahead of the work (as the step's plan bounds it)."""
        monkeypatch.setattr(module, "QUERY_CHUNK", chunk)
        out = module.attention(q, k, v, 0.125, blocked=False)
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        with allocation_bound(0):
            mx.eval(out)
        mx.synchronize()
        return mx.get_peak_memory() - base

    assert live(4096) >= scores  # one chunk: MLX's SDPA materialises the scores
    assert live(256) < scores // 2  # eight chained chunks: about one chunk's at a time


@pytest.mark.skipif(
    mx.default_device() != mx.cpu,
    reason="cpu_ops' blocked attention runs on MLX's CPU backend alone (GPUs have fused kernels)",
)
@pytest.mark.parametrize("causal, valid_keys", [(False, None), (True, None), (True, 37)])
def test_the_encoders_attention_in_float32_is_cpu_ops(monkeypatch, causal, valid_keys):
    """chunked_attention (the text encoders', the vision tower's, the VAE's) takes cpu_ops'
    blocked attention in float32, within float32's rounding of MLX's SDPA under the same mask;
    bfloat16, and a few query rows (a decode step), keep MLX's SDPA."""
    q, k, v = qkv(90, 90, mx.float32)
    k, v = k[:, :2], v[:, :2]  # grouped queries, as the Qwen3 encoders have them
    mask = None
    if causal:
        rows, keys = mx.arange(90)[:, None], mx.arange(90)[None, :]
        mask = (keys <= rows) & (keys < (valid_keys or 90))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    calls = []
    monkeypatch.setattr(
        module.cpu_ops, "attention", lambda *a: calls.append(a) or cpu_attention(*a)
    )
    got = module.chunked_attention(q, k, v, 0.125, causal, valid_keys)
    assert len(calls) == 1 and rel_l2(got, expected) < 1e-6
    module.chunked_attention(q.astype(mx.bfloat16), k, v, 0.125, causal, valid_keys)
    module.chunked_attention(q[:, :, :1], k, v, 0.125, False)  # a decode step's one row
    assert len(calls) == 1


cpu_attention = module.cpu_ops.attention
