"""Activations and norms as the families' networks use them."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from . import cpu_ops


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), with cpu_ops' vectorising sigmoid for float32 on the CPU backend."""
    sigmoid = cpu_ops.sigmoid if cpu_ops.use_cpu_ops(x.dtype) else mx.sigmoid
    return x * sigmoid(x)


def gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def layer_norm(x: mx.array, eps: float) -> mx.array:
    """Layer norm without scale or bias (the DiTs modulate instead)."""
    return mx.fast.layer_norm(x, None, None, eps)


# transformers' `hidden_act` names -> MLX's functions.
HIDDEN_ACTIVATIONS = {
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_new": nn.gelu_approx,
    "gelu": nn.gelu,
    "silu": nn.silu,
    "quick_gelu": nn.gelu_fast_approx,
}


def hidden_activation(name: str):
    """The activation a transformers config names, or ValueError."""
    if name not in HIDDEN_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}")
    return HIDDEN_ACTIVATIONS[name]
