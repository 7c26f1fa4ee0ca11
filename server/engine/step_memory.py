"""The memory plan of a step over joint token sequences (docs/contract.md §3.5), shared by the
DiTs whose blocks run every token of a row in one sequence with full attention (FLUX.2 klein,
FLUX.3 klein, MOSS-Image): a family's model is a `JointTokenModel` that says how many buffers
of its shapes a token holds (`TokenBuffers`, from its tiny model's measured peaks) and
`joint_step_peak_bytes` adds them up with the attention's scores, for a step and for the
reference workload (`reserve_bytes`). Pure: no allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .family import RESERVE_ROWS, FamilyModel
from .nn import cpu_ops


@dataclass(frozen=True)
class TokenBuffers:
    """Buffers a token of a row holds at a block's peak: at the DiT's width in the compute
    dtype (`width`), at its width in float32 (`f32`: q and k around their norm and RoPE), at
    its MLP's width (`mlp`), and cpu_ops.attention's block of scores and its temporaries
    (`score_block`)."""

    width: int
    f32: int
    mlp: int
    score_block: int


def joint_step_peak_bytes(
    buffers: TokenBuffers,
    dim: int,
    mlp_dim: int,
    heads: int,
    itemsize: int,
    lengths: list[int],
    blocked: bool,
) -> int:
    """Peak bytes of one step beyond the weights for rows of `lengths` joint tokens each, the
    attention's scores blocked (cpu_ops, a block per row of a batch) or fused (the whole
    score matrix per row)."""
    if not lengths:
        return 0
    longest = max(lengths)
    per_token = (
        buffers.width * dim * itemsize + buffers.f32 * dim * 4 + buffers.mlp * mlp_dim * itemsize
    )
    total = sum(lengths) * per_token
    if blocked:
        rows, group = cpu_ops._block_shape(heads, longest, longest)
        total += len(lengths) * buffers.score_block * min(rows, longest) * group * longest * 4
    else:
        total += len(lengths) * heads * longest * longest * itemsize
    return total


class JointTokenModel(FamilyModel):
    """The model of a family whose DiT runs every token of a row in one sequence: its step's
    peak is `joint_step_peak_bytes` of its `BUFFERS` at its DiT config's `dim`, `mlp_dim` and
    `num_heads`; its reference workload's rows hold `RESERVE_TEXT` text tokens beside the
    image's."""

    BUFFERS: TokenBuffers
    RESERVE_TEXT: int

    @classmethod
    def peak_bytes(cls, config: Any, itemsize: int, lengths: list[int], blocked: bool) -> int:
        """Peak bytes of one step beyond the weights for rows of `lengths` joint tokens each
        (text, image and the references that run with them)."""
        return joint_step_peak_bytes(
            cls.BUFFERS, config.dim, config.mlp_dim, config.num_heads, itemsize, lengths, blocked
        )

    def rows_peak_bytes(self, lengths: list[int]) -> int:
        """`peak_bytes` on the loaded DiT (its `cpu_ops` was read at load: the quick plan runs
        on an HTTP thread and never asks MLX)."""
        return self.peak_bytes(self.dit.config, self.dit.dtype.size, lengths, self.dit.cpu_ops)

    @classmethod
    def reserve_bytes(cls, config: Any, image_tokens: int, dtype: mx.Dtype) -> int:
        rows = [image_tokens + cls.RESERVE_TEXT] * RESERVE_ROWS
        return cls.peak_bytes(config, dtype.size, rows, cpu_ops.use_cpu_ops(dtype))
