"""Compute dtypes, their wire names, and walking a weight tree (nested dicts and lists).

Which dtype each network computes in is decided here, once per kind of network:
`default_compute_dtype` for the DiT, `encoder_vae_dtype` for the text encoder and the VAE (whose
default a model entry's `encoder_vae_dtype` setting overrides, precision.ENCODER_VAE_DTYPES).
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from ..precision import AUTO

DTYPE_NAMES = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def default_compute_dtype() -> mx.Dtype:
    """The DiT's: float32 on the CPU backend (its bf16 matmuls are slow and lossy), bf16 on GPU
    backends."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def encoder_vae_dtype(setting: str = AUTO) -> mx.Dtype:
    """The text encoder's and the VAE's: the dtype a setting names (f32, bf16, f16), else, for
    `auto`, bf16 on GPU backends (half the memory of float32) and float32 on the CPU backend,
    where bf16 is no faster: the 8B encoder's decoder layer runs about 40x slower in bf16 there
    (MLX has no bf16 GEMM on the CPU), the VAE's convolutions within 10% of float32, and both
    lose 3e-3 or more (docs/benchmarks.md, "Encoder and VAE dtypes")."""
    if setting != AUTO:
        return DTYPES[setting]
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


def eval_leaf_by_leaf(tree) -> None:
    """Evaluate a loaded weight tree one array at a time, so that beside the arrays already
    loaded only one array's sources are in flight (a cast's stored tensor, a fused weight's
    parts); one `mx.eval` of the whole tree lets MLX read many of them first."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, mx.array):
            mx.eval(leaf)
