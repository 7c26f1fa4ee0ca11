"""One DiT over several processes (MLX's `mx.distributed`): the shard plan a family declares,
the slice of the weight tree each rank holds, and the two ways the blocks run.

A family declares, once, in its `dit.py`, a `ShardPlan`: which block lists (`stacks`) form the
pipeline, which fused block weights are split by their output rows (`columns`, with their
equal segments: q/k/v, gate/up) and which by their input columns (`rows`, whose partial
products are summed over the ranks). Nothing here names a block or a layer of a family.

- **pipeline**: rank r holds a contiguous run of the blocks; the activations pass once per stage
  boundary (rank r to r + 1, the last rank back to rank 0 when the stack's output is needed).
- **tensor** (Megatron): every rank holds every block, each fused `columns` weight cut by
  output rows (each segment split alike, in whole units such as heads), each `rows` weight cut by
  input columns, its partial output summed with `all_sum`. Heads split with the rows of q/k/v.

Every rank runs the same forward on the same inputs (SPMD): what a rank does not hold it skips
(pipeline) or holds a slice of (tensor). The layers outside the stacks (embedders, modulation,
final projection) are small and replicated on every rank. A LoRA pair is sliced as its weight
is: the up matrix by the weight's output rows, the down matrix by its input columns.

Quantized weights slice as float ones: by output rows (packed words, scales and biases alike),
or by input columns in whole quantization groups. Slicing quantized weights at load equals
quantizing the whole weight and slicing it, so a sharded quantized model computes what the one
process computes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from .base import EngineInputError
from .ggml_blocks import LAYOUT, BlockLayout, take_columns, take_rows
from .quantize import BIASES, SCALES, SPEC, logical_shape
from .shard_plan import MODES, Shard, ShardPlan, Split, stage_bounds

__all__ = ["MODES", "Shard", "ShardPlan", "Split", "Stages", "TreeShard", "all_sum"]

# Beside a `rows` weight of a rank's tree in tensor mode: its partial output is summed over the
# ranks (lora.project reads it).
REDUCE = ".reduce"

# Bytes this process handed to the distributed backend, by kind ("send", "all_sum", and the
# step inputs' broadcast, "inputs", counted in server/distributed.py), counted as
# the collectives are built: what docs/benchmarks.md compares with the computed volume. An
# all_sum over the ring moves 2 (N - 1) / N of its bytes out of each rank.
TRAFFIC: Counter = Counter()


class TreeShard:
    """What a rank keeps of a DiT's weight tree under a plan: `slice(tree)` before any
    quantization at load (tensor by tensor, each slice evaluated before the next, so the whole
    model is never in memory), `mark(tree)` after it; and the LoRA pairs' slices."""

    def __init__(self, plan: ShardPlan, shard: Shard, depths: dict[str, int]):
        self.plan, self.shard = plan, shard
        self.depths = depths  # blocks per stack
        total = sum(depths[stack] for stack in plan.stacks)
        self.bounds = stage_bounds(total, shard.size) if shard.pipeline else []
        self.full_shapes: dict[tuple, tuple[int, int]] = {}  # (path, key) -> logical (out, in)
        self._unread = tuple(  # the checkpoint name prefixes of the blocks other ranks run
            prefix.format(index)
            for stack, prefix in plan.prefixes.items()
            for index in range(depths[stack])
            if not self.owned(stack, index)
        )

    # -- which blocks a rank runs -----------------------------------------------------------

    def owner(self, stack: str, index: int) -> int:
        """The rank that runs block `index` of `stack` (0 outside pipeline mode)."""
        if not self.bounds:
            return self.shard.rank
        position = index
        for name in self.plan.stacks:
            if name == stack:
                break
            position += self.depths[name]
        return next(r for r, (start, stop) in enumerate(self.bounds) if start <= position < stop)

    def owned(self, stack: str, index: int) -> bool:
        return self.owner(stack, index) == self.shard.rank

    def reads(self, name: str) -> bool:
        """Whether this rank reads the checkpoint tensor `name` (a diffusers name): every one
        but those of the blocks other ranks run (pipeline mode; the plan's `prefixes`)."""
        return not name.startswith(self._unread)

    # -- the weights ------------------------------------------------------------------------

    def slice(self, tree: dict) -> dict:
        """The rank's tree: in pipeline mode the blocks of other ranks become empty dicts (never
        read from the files); in tensor mode each block's `columns` and `rows` weights become
        this rank's slice. Every kept leaf is evaluated in turn."""
        for stack in self.plan.stacks:
            blocks = tree[stack]
            for index, block in enumerate(blocks):
                self._note_shapes(block, (stack, index))
                if not self.owned(stack, index):
                    blocks[index] = {}
                    continue
                for key in list(block):
                    self._slice_leaf(block, key, (stack, index))
        return tree

    def _note_shapes(self, block: dict, path: tuple) -> None:
        """The whole DiT's (out, in) of each linear weight of a block (LoRA tables are checked
        and placed against them), from the shapes alone."""
        for key, value in block.items():
            if isinstance(value, mx.array) and (
                key + LAYOUT in block or (value.ndim == 2 and not key.endswith((SCALES, BIASES)))
            ):
                self.full_shapes[(path, key)] = logical_shape(block, key)

    def _slice_leaf(self, node: dict, key: str, path: tuple) -> None:
        value = node[key]
        if not isinstance(value, mx.array) or key.endswith((SCALES, BIASES)):
            return
        if self.shard.tensor and (key in self.plan.columns or key in self.plan.rows):
            for name, part in self._cut(node, key, path).items():
                node[name] = part
                if isinstance(part, mx.array):
                    mx.eval(part)
        else:
            mx.eval(value)

    def _cut(self, node: dict, key: str, path: tuple) -> dict[str, mx.array]:
        """The rank's slice of the weight `key` (with its scales and biases when quantized)."""
        out_rows, in_cols = logical_shape(node, key)
        where = f"{'.'.join(map(str, path))}.{key}"
        if key + LAYOUT in node:
            return self._cut_blocks(node, key, where)
        names = [key] + ([key + SCALES, key + BIASES] if key + SPEC in node else [])
        if key in self.plan.columns:
            rows = self.column_rows(self.plan.columns[key], out_rows, where)
            return {name: node[name][mx.array(rows)] for name in names}
        start, stop = self.input_columns(self.plan.rows[key], in_cols, where)
        cut = {}
        for name in names:
            array = node[name]
            per_col = array.shape[1] / in_cols  # packed words and groups per input column
            lo, hi = start * per_col, stop * per_col
            if lo != int(lo) or hi != int(hi):
                raise EngineInputError(
                    f"{where}: its {in_cols} input columns cut over {self.shard.size} ranks do not"
                    " fall on whole quantization groups; use a smaller group size or another"
                    " rank count"
                )
            cut[name] = array[:, int(lo) : int(hi)]
        return cut

    def _cut_blocks(self, node: dict, key: str, where: str) -> dict:
        """The rank's slice of a weight held as a GGUF file's blocks, and its layout."""
        layout = BlockLayout.of(node[key + LAYOUT])
        if key in self.plan.columns:
            rows = self.column_rows(self.plan.columns[key], layout.rows, where)
            data, cut = take_rows(node[key], layout, rows)
        else:
            start, stop = self.input_columns(self.plan.rows[key], layout.cols, where)
            taken = take_columns(node[key], layout, start, stop)
            if taken is None:
                raise EngineInputError(
                    f"{where}: its {layout.cols} input columns cut over {self.shard.size} ranks"
                    " do not fall on whole blocks of its GGUF types; use another rank count"
                )
            data, cut = taken
        return {key: data, key + LAYOUT: cut.constants()}

    def column_rows(self, split: Split, rows: int, where: str) -> np.ndarray:
        """The output rows a rank keeps: its chunk of each segment."""
        size, rank = self.shard.size, self.shard.rank
        segment = rows // split.segments
        if segment * split.segments != rows or segment % (split.unit * size):
            raise EngineInputError(
                f"{where}: {split.segments} segment(s) of {segment} rows cannot be split into"
                f" {size} equal parts{_of_units(split.unit, 'rows')}"
            )
        chunk = segment // size
        return np.concatenate(
            [
                np.arange(s * segment + rank * chunk, s * segment + (rank + 1) * chunk)
                for s in range(split.segments)
            ]
        )

    def input_columns(self, split: Split, cols: int, where: str) -> tuple[int, int]:
        """The [start, stop) input columns a rank keeps."""
        size, rank = self.shard.size, self.shard.rank
        if cols % (split.unit * size):
            raise EngineInputError(
                f"{where}: {cols} input columns cannot be split into {size} equal parts"
                f"{_of_units(split.unit, 'columns')}"
            )
        chunk = cols // size
        return rank * chunk, (rank + 1) * chunk

    def mark(self, tree: dict) -> None:
        """Mark each `rows` weight whose partial output the ranks sum (tensor mode)."""
        if not self.shard.tensor:
            return
        for stack in self.plan.stacks:
            for block in tree[stack]:
                for key in self.plan.rows:
                    if key in block:
                        block[key + REDUCE] = True

    # -- LoRA pairs -------------------------------------------------------------------------

    def layer_shape(self, slot, tree: dict) -> tuple[int, int]:
        """A slot's layer (out, in) as the whole DiT has it, whatever this rank holds."""
        full = self.full_shapes.get((slot.path, slot.key))
        if full is None:
            return slot.layer_shape(tree)
        return full[0] // slot.parts, full[1]

    def keeps(self, slot) -> bool:
        """Whether this rank holds the weight a slot lives in."""
        path = slot.path
        if len(path) == 2 and path[0] in self.plan.stacks:
            return self.owned(path[0], path[1])
        return True

    def slice_pair(self, slot, down: np.ndarray, up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A pair over a whole fused weight cut as the weight is: up by its output rows, down by
        its input columns."""
        full = self.full_shapes.get((slot.path, slot.key))
        if full is None or not self.shard.tensor:
            return down, up
        where = f"{'.'.join(map(str, slot.path))}.{slot.key}"
        if slot.key in self.plan.columns:
            return down, up[self.column_rows(self.plan.columns[slot.key], full[0], where)]
        start, stop = self.input_columns(self.plan.rows[slot.key], full[1], where)
        return down[:, start:stop], up


def _of_units(unit: int, what: str) -> str:
    return "" if unit == 1 else f" of whole heads ({unit} {what} each)"


# ---------------------------------------------------------------- running the blocks


class Stages:
    """How a DiT's block stacks run in this process: all of them (one process, tensor mode), or
    this rank's stage of the pipeline, passing the activations on at its boundaries."""

    def __init__(self, tree_shard: TreeShard | None = None, group: Any = None):
        self.tree_shard = tree_shard
        self.group = group

    @property
    def pipeline(self) -> bool:
        return self.tree_shard is not None and self.tree_shard.shard.pipeline

    def run(
        self,
        stack: str,
        blocks: list,
        x: mx.array,
        body: Callable[[int, dict, mx.array], mx.array],
        keep_output: bool = True,
    ) -> mx.array:
        """x through the stack's blocks, `body(index, block, x)` each. In pipeline mode the
        stack's input is rank 0's (sent to the first stage when that is another rank's); a rank
        runs its own blocks on what the previous stage sent, sends the result on, and, with
        `keep_output`, rank 0 gets the last stage's output (the other ranks return an output
        nobody reads: never evaluated)."""
        if not self.pipeline:
            for index, block in enumerate(blocks):
                x = body(index, block, x)
            return x
        shard = self.tree_shard
        rank = shard.shard.rank
        owners = [shard.owner(stack, i) for i in range(len(blocks))]
        mine = [i for i, owner in enumerate(owners) if owner == rank]
        if rank == 0 and owners[0] != 0:
            mx.eval(self._send(x, owners[0]))
        if mine:
            before = owners[mine[0] - 1] if mine[0] > 0 else 0
            if before != rank:
                x = self._recv(x, before)
            for index in mine:
                x = body(index, blocks[index], x)
            after = owners[mine[-1] + 1] if mine[-1] + 1 < len(blocks) else None
            if after is None and keep_output and rank != 0:
                after = 0
            if after is not None:
                mx.eval(self._send(x, after))  # now: a stage never waits on its own send
        if rank == 0 and keep_output and owners[-1] != 0:
            x = self._recv(x, owners[-1])
        return x

    def _send(self, x: mx.array, to: int) -> mx.array:
        TRAFFIC["send"] += x.nbytes
        return mx.distributed.send(x, to, group=self.group)

    def _recv(self, like: mx.array, source: int) -> mx.array:
        # Now, as the send: every rank meets its boundaries in the order they were built (a
        # lazy receive could be evaluated after a later one and take its bytes).
        received = mx.distributed.recv_like(like, source, group=self.group)
        mx.eval(received)
        return received


def all_sum(x: mx.array) -> mx.array:
    """The sum of x over the ranks (a `rows` weight's partial outputs)."""
    size = mx.distributed.init().size()
    TRAFFIC["all_sum"] += x.nbytes * 2 * (size - 1) // size
    return mx.distributed.all_sum(x)
