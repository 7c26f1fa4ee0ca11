"""The memory plan of a step over joint token sequences (docs/contract.md §3.5), shared by the
DiTs whose blocks run every token of a row in one sequence with full attention (FLUX.2 klein,
FLUX.3 klein, MOSS-Image): a family says how many buffers of its shapes a token holds
(`TokenBuffers`, from its tiny model's measured peaks) and `joint_step_peak_bytes` adds them
up with the attention's scores; `joint_step_reserve` is the reference workload's. Pure: no
allocation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .family import RESERVE_PIXELS, RESERVE_ROWS
from .nn import cpu_ops
from .vaes.autoencoder_kl_flux2 import latent_facts
from .weights import read_config


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


def joint_step_reserve(
    model_dir: Path, dtype: mx.Dtype, config_type: type, peak: Callable, text_tokens: int
) -> int:
    """A guided step of the reference workload beyond the weights (family.RESERVE_*): rows of
    a RESERVE_PIXELS square's latent tokens (FLUX.2's VAE) and `text_tokens` each, by the
    family's `peak(config, itemsize, lengths, blocked)` for the folder's DiT config."""
    model_dir = Path(model_dir)
    config = config_type.from_dict(read_config(model_dir / "transformer"))
    cells = RESERVE_PIXELS // latent_facts(read_config(model_dir / "vae"))["stride"]
    row = cells * cells + text_tokens
    return peak(config, dtype.size, [row] * RESERVE_ROWS, cpu_ops.use_cpu_ops(dtype))
