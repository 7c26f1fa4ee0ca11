"""Transcendental-heavy ops rewritten for MLX's Linux CPU backend, and a guard for `mx.compile`.

Why this exists (measured in bench/mlx_ops.py, docs/benchmarks.md "DiT forward"): the Linux
`mlx[cpu]` wheel is built for baseline x86-64 and its CPU kernels run one element at a time
(`Simd<T, 1>`). `mx.exp` is a Cephes polynomial whose `floor` is a libm call per element, so it
never vectorises: about 18 ns per float32, 50x numpy's. `mx.softmax` and the CPU fallback of
`mx.fast.scaled_dot_product_attention` pay that per score, and `mx.sigmoid`/`mx.tanh` (libm)
about 40 ns. Plain arithmetic, integer shifts and casts do vectorise, eager and in the kernels
that `mx.compile` builds with g++ at run time. So exp2 is written here from those pieces:
round by a magic-number add, a degree-6 polynomial for the fraction, and the power of two built
in the exponent bits. Attention then runs in blocks of query rows whose scores stay in cache,
with the softmax denominator taken by the P @ [V, 1] matmul instead of a separate reduction.

Everything here is free of host synchronisation, so it traces under `mx.compile`.
"""

from __future__ import annotations

import logging
import shutil

import mlx.core as mx

log = logging.getLogger(__name__)

LOG2_E = 1.4426950408889634
# 2**f for f in [-0.5, 0.5], highest power first (the Cephes exp2f coefficients MLX uses too).
_EXP2_COEFFICIENTS = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)
# 1.5 * 2**23: (x + c) - c rounds a float32 |x| < 2**22 to the nearest integer, with no libm call.
_ROUND_MAGIC = 12582912.0
# Bytes of scores one attention block may hold: small enough to stay in a core's L2 with the
# exponentials beside it, large enough that each block's matmuls keep the BLAS busy.
SCORE_BLOCK_BYTES = 2 << 20
# A masked score's bias in log2 units: finite (exp2_nonpositive has no infinity path), within
# its rounding trick's range, and far enough below any row's max (a row always sees its first
# key) that exp2 gives 0.
MASKED_LOG2 = -float(2**20)
_MIN_BLOCK_ROWS = 32


def exp2_nonpositive(x: mx.array) -> mx.array:
    """2**x for finite float32 x <= 0, relative error about 1e-7. Below -127 it returns 0
    (2**-127 is under float32's normal range; nothing here needs subnormals); -inf gives NaN,
    so masks must use a finite large negative instead."""
    rounded = (x + _ROUND_MAGIC) - _ROUND_MAGIC
    fraction = x - rounded
    power = _EXP2_COEFFICIENTS[0]
    for coefficient in _EXP2_COEFFICIENTS[1:]:
        power = power * fraction + coefficient
    exponent = mx.maximum(rounded.astype(mx.int32), -127) + 127
    return power * (exponent << 23).view(mx.float32)


def sigmoid(x: mx.array) -> mx.array:
    """1 / (1 + e^-x) for float32 x, from e = e^-|x| <= 1 (no overflow): 1 / (1 + e) where
    x >= 0 and e / (1 + e) below, picked by arithmetic on sign(x) rather than a select (MLX's
    boolean kernels do not vectorise). Relative error about 2e-6. Finite |x| < 2e38 (beyond,
    -|x| log2 e overflows to -inf and exp2 has no infinity path)."""
    e = exp2_nonpositive(mx.abs(x) * -LOG2_E)
    step = (mx.sign(x) + 1.0) * 0.5
    return (e + (1.0 - e) * step) / (1.0 + e)


def use_cpu_ops(dtype: mx.Dtype) -> bool:
    """Whether the rewritten ops apply: float32 on the CPU backend (GPU backends have fused,
    vectorised kernels of their own, and the rounding trick is float32's)."""
    return dtype == mx.float32 and mx.default_device() == mx.cpu


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    causal: bool = False,
    valid_keys: int | None = None,
) -> mx.array:
    """softmax(q k^T * scale) v for float32 q (B, H, N, D), k and v (B, Hk, M, D) (Hk dividing H:
    grouped queries as MLX's SDPA takes them); `causal`
    (N == M): query i sees keys 0..i, and with `valid_keys` (at least 1) only those below it
    (a right-padded prompt's padding, masked for every query as transformers masks it).

    Scores are computed in blocks of (heads, query rows) of about SCORE_BLOCK_BYTES each, in
    log2 units (scale * log2 e folded into q), so each block's max, exp2 and matmuls run on
    data in cache. A causal block reads the keys up to its last row alone, and masks by adding
    a bias made by arithmetic (`_causal_bias`). A dependency chains the blocks: MLX would
    otherwise schedule up to 20 of them side by side (its breadth-first evaluation), and blocks
    too large for its allocator's cache cost a page fault per 4 KiB on every call."""
    heads, rows_total, head_dim = q.shape[1], q.shape[2], q.shape[3]
    keys = k.shape[2]
    if k.shape[1] != heads:  # grouped queries: query head h reads key head h // (H / Hk)
        k, v = (mx.repeat(t, heads // k.shape[1], axis=1) for t in (k, v))
    q = q * (scale * LOG2_E)
    keys_t = k.swapaxes(-1, -2)
    # A ones column: P @ [V, 1] yields the numerator and the softmax denominator together.
    values = mx.concatenate([v, mx.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)
    rows, group = _block_shape(heads, rows_total, keys)
    row_blocks = [(r0, min(r0 + rows, rows_total)) for r0 in range(0, rows_total, rows)]
    # a row block's mask, the same for every group of heads
    biases = [_causal_bias(r0, r1, valid_keys) if causal else None for r0, r1 in row_blocks]
    head_outputs, previous = [], None
    for h0 in range(0, heads, group):
        heads_here = slice(h0, h0 + group)
        row_outputs = []
        for (r0, r1), bias in zip(row_blocks, biases, strict=True):
            seen = r1 if causal else keys  # a causal block sees no key past its last row
            block_q = q[:, heads_here, r0:r1]
            if previous is not None:
                block_q = mx.depends(block_q, previous)
            scores = block_q @ keys_t[:, heads_here, :, :seen]
            if bias is not None:
                scores = scores + bias
            weights = exp2_nonpositive(scores - scores.max(axis=-1, keepdims=True))
            weighted = weights @ values[:, heads_here, :seen]
            previous = weighted[..., :head_dim] / weighted[..., head_dim:]
            row_outputs.append(previous)
        head_outputs.append(_concatenate(row_outputs, axis=2))
    return _concatenate(head_outputs, axis=1)


def _causal_bias(r0: int, r1: int, valid_keys: int | None) -> mx.array:
    """(r1 - r0, r1) scores' bias of query rows r0..r1-1 over keys 0..r1-1: 0 where the row sees
    the key, else MASKED_LOG2. Made by arithmetic (the distance past the last key seen, clipped
    to -1..0 and scaled), not a comparison and a select: MLX's boolean kernels do not vectorise
    on the CPU."""
    last_seen = mx.arange(r0, r1)[:, None]
    if valid_keys is not None:
        last_seen = mx.minimum(last_seen, valid_keys - 1)
    masked = mx.clip(last_seen - mx.arange(r1)[None, :], -1, 0)  # -1 past the last key seen
    return masked.astype(mx.float32) * -MASKED_LOG2


def _block_shape(heads: int, rows_total: int, keys: int) -> tuple[int, int]:
    """(query rows, heads) per block: whole heads while a head's rows fit the budget, else at
    least _MIN_BLOCK_ROWS rows of one head."""
    rows_in_budget = SCORE_BLOCK_BYTES // (4 * max(1, keys))
    rows_total = max(1, rows_total)  # an estimate of no rows (a latent too small to patchify)
    if rows_in_budget >= rows_total:
        return rows_total, max(1, min(heads, rows_in_budget // rows_total))
    return max(_MIN_BLOCK_ROWS, rows_in_budget), 1


def _concatenate(arrays: list[mx.array], axis: int) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=axis)


# ---------------------------------------------------------------------------------------------
# mx.compile on the CPU backend


def compile_failed(error: BaseException) -> bool:
    """Whether `error` (raised while evaluating a compiled function) is MLX's CPU compiler
    failing: g++ present but unable to build the kernel, or no usable temporary directory for
    the kernel sources (TMPDIR naming a missing folder)."""
    text = str(error)
    return "[Compile::" in text or "temp_directory_path" in text


def note_missing_compiler() -> None:
    """Log once when mx.compile cannot fuse on the CPU backend: MLX runs `g++` from PATH to
    build fused kernels, and without it compiled functions silently run op by op."""
    global _compiler_noted
    if _compiler_noted or mx.default_device() != mx.cpu:
        return
    _compiler_noted = True
    if shutil.which("g++") is None:
        log.info(
            "no g++ on PATH: mx.compile runs op by op on the CPU backend "
            "(install g++ for fused elementwise kernels)"
        )


_compiler_noted = False
