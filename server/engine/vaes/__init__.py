"""The VAEs, one module each, shared by every family whose folder carries that VAE. A VAE
provides what engine/family.py's FamilyModel asks of it (encode, decode, out_channels,
peak_bytes, to_model_space, from_model_space)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..nn.dtypes import eval_leaf_by_leaf


def load_checkpoint(model: nn.Module, converted: list[tuple[str, mx.array]]) -> int:
    """Put a VAE's checkpoint weights (already in the module's names and layouts) into its
    module, every parameter required; the bytes they hold."""
    try:
        model.load_weights(converted, strict=True)
    except ValueError as error:
        raise ValueError(f"VAE weights do not match its config: {error}") from None
    eval_leaf_by_leaf(model.parameters())
    return sum(value.nbytes for _, value in converted)
