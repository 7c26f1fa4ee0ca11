"""Compute dtypes, their wire names, and walking a weight tree (nested dicts and lists)."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

DTYPE_NAMES = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}


def default_compute_dtype() -> mx.Dtype:
    """float32 on the CPU backend (its bf16 matmuls are slow and lossy), bf16 on GPU backends."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def dtype_name(dtype: mx.Dtype) -> str:
    """The status name of a compute dtype: f32, f16 or bf16."""
    return DTYPE_NAMES[dtype]


def tree_leaves(tree) -> Iterator:
    """The arrays of a tree of dicts and lists, depth first."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from tree_leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from tree_leaves(value)
    else:
        yield tree


def tree_bytes(tree) -> int:
    """Bytes of the arrays a tree holds, as loaded (its constants, such as a quantized
    weight's (bits, group_size), hold none)."""
    return sum(leaf.nbytes for leaf in tree_leaves(tree) if isinstance(leaf, mx.array))
