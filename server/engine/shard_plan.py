"""The shard plan of a DiT and a process's place in its rank group, without MLX (the command
line reads `MODES` before MLX is set up): the plan's meaning is in shard.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import EngineInputError

MODES = ("pipeline", "tensor")


@dataclass(frozen=True)
class Split:
    """How one block weight is cut: into `segments` equal row groups (q, k, v: 3), each split
    into N equal chunks of whole `unit`s (a head: head_dim rows)."""

    segments: int = 1
    unit: int = 1


@dataclass(frozen=True)
class ShardPlan:
    """A family's shard plan: the block lists of the pipeline, in order, and the block weights
    split by output rows (`columns`) and by input columns (`rows`), by their key in a block;
    `prefixes`: each stack's block names in the checkpoint (diffusers names, `{}` for the block
    index), so a rank of a pipeline reads no other rank's blocks from a GGUF file."""

    stacks: tuple[str, ...]
    columns: dict[str, Split] = field(default_factory=dict)
    rows: dict[str, Split] = field(default_factory=dict)
    prefixes: dict[str, str] = field(default_factory=dict)


def attention_mlp_plan(
    stacks: dict[str, str], head_dim: int, mlp: tuple[str, str] = ("gate_up", "down")
) -> ShardPlan:
    """The split of blocks of attention and a gated MLP, `stacks` their checkpoint prefixes by
    stack in pipeline order: the fused q/k/v (`qkv`: three segments of whole heads) and the
    MLP's fused input (two segments) by output rows, the attention's output (`out`, in whole
    heads) and the MLP's output by input columns (`mlp`: the two MLP weights' keys)."""
    mlp_in, mlp_out = mlp
    return ShardPlan(
        stacks=tuple(stacks),
        columns={"qkv": Split(3, head_dim), mlp_in: Split(2)},
        rows={"out": Split(1, head_dim), mlp_out: Split(1)},
        prefixes=dict(stacks),
    )


@dataclass(frozen=True)
class Shard:
    """This process's place in the group: the mode, its rank and the group's size."""

    mode: str
    rank: int
    size: int

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"shard mode is one of {', '.join(MODES)}, not {self.mode!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")

    @property
    def tensor(self) -> bool:
        return self.mode == "tensor" and self.size > 1

    @property
    def pipeline(self) -> bool:
        return self.mode == "pipeline" and self.size > 1


def stage_bounds(blocks: int, size: int) -> list[tuple[int, int]]:
    """The contiguous [start, stop) of the blocks each rank runs: as even as whole blocks allow,
    the last ranks taking the extra ones (rank 0 holds the text encoder and the VAE besides)."""
    if blocks < size:
        raise EngineInputError(f"{blocks} blocks cannot form a pipeline over {size} ranks")
    cuts = [r * blocks // size for r in range(size + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))
