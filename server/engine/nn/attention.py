"""Attention over (B, H, N, D) arrays, with the CPU backend's rewrites where they apply."""

from __future__ import annotations

import mlx.core as mx

from . import cpu_ops

# Attention runs over at most this many query rows at a time, so that where MLX materialises the
# scores (its CPU backend) they stay bounded: ten 1024x1024 references make ~10k text-encoder rows.
QUERY_CHUNK = 1024
# Fewer query rows than this take MLX's SDPA even where cpu_ops applies: a decode step's one
# row has few scores to exponentiate, and the blocked form would copy the key/value cache (its
# ones column, its grouped heads repeated). Measured at 8 query heads over 2, 3,000 keys of
# 256: one row 9.9 ms by MLX's SDPA against 25.7 blocked; 16 rows 144 against 156; 64 rows even.
BLOCKED_MIN_ROWS = 32


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, blocked: bool) -> mx.array:
    """Unmasked attention; `blocked` (cpu_ops.use_cpu_ops of the compute dtype, read once by the
    caller): the blocked exp2 form of cpu_ops (MLX's CPU SDPA is matmul, scalar-exp softmax,
    matmul over the whole score matrix), else MLX's fused attention, which on the CPU backend
    (another dtype than float32) runs over QUERY_CHUNK query rows at a time."""
    if blocked:
        return cpu_ops.attention(q, k, v, scale)
    if mx.default_device() == mx.cpu and q.shape[2] > QUERY_CHUNK:
        return chained_query_chunks(q, k, v, scale)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def chained_query_chunks(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Unmasked attention over QUERY_CHUNK query rows at a time, each chunk's queries waiting
    on the chunk before (mx.depends): MLX's breadth-first evaluation would otherwise compute
    every chunk's scores side by side, as many as the whole score matrix. Exact: each query
    row's softmax is over all the keys either way."""
    outputs, previous = [], None
    for start in range(0, q.shape[2], QUERY_CHUNK):
        chunk = q[:, :, start : start + QUERY_CHUNK]
        if previous is not None:
            chunk = mx.depends(chunk, previous)
        previous = mx.fast.scaled_dot_product_attention(chunk, k, v, scale=scale)
        outputs.append(previous)
    return mx.concatenate(outputs, axis=2)


def chunked_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    causal: bool,
    valid_keys: int | None = None,
) -> mx.array:
    """Scaled dot-product attention over (B, H, L, D), query rows in chunks. A causal chunk of
    rows [start, end) sees keys [0, end): MLX aligns its causal mask to the last key. With
    `valid_keys` (causal only) the keys from that index on are masked for every query (a
    right-padded batch's padding, as transformers masks it); it must be at least 1. In float32
    on the CPU backend, cpu_ops' blocked attention (MLX's SDPA there is a scalar-exp softmax
    over each chunk's whole score matrix), from BLOCKED_MIN_ROWS query rows on."""
    length = q.shape[2]
    blocked = cpu_ops.use_cpu_ops(q.dtype) and length >= BLOCKED_MIN_ROWS
    if blocked and (not causal or k.shape[2] == length):
        return cpu_ops.attention(q, k, v, scale, causal, valid_keys)
    outputs = []
    for start in range(0, length, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, length)
        keys, values = (k[:, :, :end], v[:, :, :end]) if causal else (k, v)
        mask = "causal" if causal else None
        if causal and valid_keys is not None and valid_keys < end:
            columns = mx.arange(end)[None, :]
            mask = (columns <= mx.arange(start, end)[:, None]) & (columns < valid_keys)
        outputs.append(
            mx.fast.scaled_dot_product_attention(
                q[:, :, start:end], keys, values, scale=scale, mask=mask
            )
        )
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)
