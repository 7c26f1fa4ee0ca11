"""What the VAEs built from a folder share: `CheckpointVAE`, a network made from its config
and its checkpoint's tensors converted to its module's names."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..nn.dtypes import eval_leaf_by_leaf
from ..weights import load_weights, read_config


def load_checkpoint(model: nn.Module, converted: list[tuple[str, mx.array]]) -> int:
    """Put a VAE's checkpoint weights (already in the module's names and layouts) into its
    module, every parameter required; the bytes they hold."""
    try:
        model.load_weights(converted, strict=True)
    except ValueError as error:
        raise ValueError(f"VAE weights do not match its config: {error}") from None
    eval_leaf_by_leaf(model.parameters())
    return sum(value.nbytes for _, value in converted)


class CheckpointVAE:
    """What a VAE network built from its folder shares: made from the folder's config at a
    compute dtype (`cls(config, dtype)`), its checkpoint's tensors converted to its module's
    names and layouts (`mlx_weights`) and put into its module (`model`), their bytes counted."""

    model: nn.Module
    weight_bytes: int = 0

    @staticmethod
    def mlx_weights(weights: dict[str, mx.array]) -> list[tuple[str, mx.array]]:
        raise NotImplementedError

    @classmethod
    def load(cls, vae_dir: Path, dtype: mx.Dtype = mx.float32):
        vae = cls(read_config(Path(vae_dir)), dtype)
        vae.load_weights(load_weights(Path(vae_dir), dtype))
        return vae

    def load_weights(self, weights: dict[str, mx.array]) -> None:
        """Take the checkpoint's weights (file names and layouts); every parameter must be there."""
        self.weight_bytes = load_checkpoint(self.model, self.mlx_weights(weights))
