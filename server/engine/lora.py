"""LoRA patch tables applied to an MLX DiT as low-rank pairs (docs/contract.md §2.9).

A table (built and schema-checked by the steps service: `PatchTable` of `PatchEntry` of
`LoraPatch`, up/down as float32 matrices) patches linear layers named as the model's manifest
names them. A DiT declares its linear layers as `LinearSlot`s: where each one lives in its
weight tree (any path of keys and indices: `blocks[3]`, `double_blocks[0].img`, the root), which
may hold several layers fused along the output rows (q/k/v as one matrix).

Application is low-rank: a linear with a table's pair computes x W^T + (x A^T) B^T (see
`project`), never a merged copy of W, so a table applies to a quantized W (quantize.py) as it
does to a float one. Measured in docs/benchmarks.md ("LoRA"): the low-rank
term costs a few per cent of a step, while a merged copy costs a second copy of every patched
weight per table (gigabytes at full size) and a merge whenever tables alternate.

Every patch of a fused weight becomes one pair over the whole fused weight: its up matrix is
placed at the layer's rows (and at a band's rows), its down matrix at a band's columns, the rest
zero; strength x scale is folded into up. All pairs of one fused weight are concatenated along the
rank, so patches on the same key and band add up and each fused weight gets one extra pair of
matmuls whatever the number of patches. A tree carrying the pairs beside the plain weights (keys
`<name>.lora_down`, `<name>.lora_up`) is what the forward receives for a step naming the table.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from .base import EngineInputError
from .quantize import linear, logical_shape
from .shard import REDUCE, TreeShard, all_sum

# Keys of a table's pair beside a linear weight `name` in a weight tree: the down matrix (R, in)
# and the up matrix (out, R) with strength and scale folded in.
LORA_DOWN = ".lora_down"
LORA_UP = ".lora_up"

# Weight trees of tables kept per model instance (least recently used dropped first).
TABLE_BUDGET_BYTES = 1 << 30


def project(w: dict, name: str, x: mx.array) -> mx.array:
    """x through the linear weight w[name] (quantized or not: quantize.linear), plus the
    low-rank term (x A^T) B^T of a LoRA table when the tree carries a pair for it; the pair
    stays in float whatever the base weight's precision."""
    out = linear(w, name, x)
    down = w.get(name + LORA_DOWN)
    if down is not None:
        # addmm accumulates into `out` inside the GEMM: no separate pass over the output.
        out = mx.addmm(out, x @ down.T, w[name + LORA_UP].T)
    if w.get(name + REDUCE):  # a weight cut by input columns over the ranks (shard.py)
        out = all_sum(out)
    return out


# A linear's bias sits beside it in a DiT's weight tree under key + BIAS (dense).
BIAS = "_bias"


def dense(w: dict, key: str, x: mx.array) -> mx.array:
    """x through the linear w[key] (`project`, LoRA-aware), plus its bias when it has one."""
    out = project(w, key, x)
    bias = w.get(key + BIAS)
    return out if bias is None else out + bias


@dataclass(frozen=True)
class LinearSlot:
    """Where a linear layer lives in a weight tree: the key of its (possibly fused) weight in the
    node that `path` leads to from the root (dict keys and list indices; () is the root), and
    which of `parts` equal row groups of that weight it is."""

    key: str
    path: tuple[str | int, ...] = ()
    part: int = 0
    parts: int = 1

    def node(self, tree: dict) -> dict:
        for step in self.path:
            tree = tree[step]
        return tree

    def layer_shape(self, tree: dict) -> tuple[int, int]:
        rows, cols = logical_shape(self.node(tree), self.key)
        return rows // self.parts, cols

    @property
    def fused(self) -> LinearSlot:
        """The slot of the whole (fused) weight, shared by all its parts."""
        return LinearSlot(self.key, self.path, 0, self.parts)


def block_slots(
    path: tuple[str, int], prefix: str, linears: dict[str, tuple[str, ...]]
) -> dict[str, LinearSlot]:
    """The slots of one block's linear layers by file name: each of `linears` (tree key -> its
    file names under `prefix`, in row order) a part of the fused weight at `path`."""
    return {
        prefix + name: LinearSlot(key, path, part, len(parts))
        for key, parts in linears.items()
        for part, name in enumerate(parts)
    }


def copy_along(tree: dict, paths) -> dict:
    """A copy of `tree` in which the dicts and lists on each of `paths` are new (so nodes there
    may be written) and everything else, leaves included, is shared with `tree`."""
    root = dict(tree)
    copied: dict[tuple, Any] = {(): root}
    for path in paths:
        for depth in range(1, len(path) + 1):
            if path[:depth] in copied:
                continue
            parent, step = copied[path[: depth - 1]], path[depth - 1]
            child = parent[step]
            parent[step] = dict(child) if isinstance(child, dict) else list(child)
            copied[path[:depth]] = parent[step]
    return root


@dataclass(frozen=True)
class Pair:
    """One patch over its whole fused weight: down (r, in) and up (fused rows, r), float32."""

    down: np.ndarray
    up: np.ndarray


def table_pairs(
    table: Any, slots: dict[str, LinearSlot], tree: dict, shard: TreeShard | None = None
) -> dict[LinearSlot, list[Pair]]:
    """Every live patch of a table placed on its fused weight, grouped by the weight it patches
    (slots of one fused weight share it: keyed by their `fused` slot). Refuses,
    as EngineInputError, a key that is not a linear layer and shapes that do not fit. Under a
    `shard` (a rank's slice of the tree) the table is checked against the whole DiT's shapes
    and each pair then cut as its weight is; the weights the rank does not hold get none."""
    grouped: dict[LinearSlot, list[Pair]] = {}
    for index, entry in enumerate(table.entries):
        where = f"entries[{index}] (key {entry.key!r})"
        slot = slots.get(entry.layer)  # the key less its prefix and `.weight` (the service's)
        if slot is None:
            raise EngineInputError(
                f"{where}: {entry.layer!r} is not a linear layer of this DiT; keys name the manifest's "
                f"linear weights, e.g. {_example_key(slots)}"
            )
        shape = slot.layer_shape(tree) if shard is None else shard.layer_shape(slot, tree)
        rows, cols = _band_window(shape, entry.band, where)
        fused = slot.fused
        for j, patch in enumerate(entry.patches):
            pair = _place(slot, shape, rows, cols, patch, f"{where} patches[{j}]")
            if pair is not None:
                grouped.setdefault(fused, []).append(pair)
    if shard is None:
        return grouped
    return {
        slot: [Pair(*shard.slice_pair(slot, pair.down, pair.up)) for pair in pairs]
        for slot, pairs in grouped.items()
        if shard.keeps(slot)
    }


def _example_key(slots: dict[str, LinearSlot]) -> str:
    """A key to show in a refusal: the first linear layer inside a block, else the first."""
    inside = [name for name, slot in slots.items() if slot.path]
    return (inside or list(slots) or ["?"])[0] + ".weight"


def _band_window(shape: tuple[int, int], band, where: str) -> tuple[range, range]:
    """The rows and columns of the layer a patch covers: all, or the band's slice."""
    out_dim, in_dim = shape
    rows, cols = range(out_dim), range(in_dim)
    if band is None:
        return rows, cols
    dim, start, length = band
    size = out_dim if dim == 0 else in_dim
    if start + length > size:
        side = "output rows" if dim == 0 else "input columns"
        raise EngineInputError(
            f"{where}: band {list(band)} runs past the layer's {size} {side} (weight {list(shape)})"
        )
    window = range(start, start + length)
    return (window, cols) if dim == 0 else (rows, window)


def _place(slot: LinearSlot, shape: tuple[int, int], rows: range, cols: range, patch, where: str):
    """A patch as a Pair over the fused weight, or None when its strength is 0 (no change)."""
    up, down = patch.up, patch.down
    if up.shape[0] != len(rows) or down.shape[1] != len(cols):
        raise EngineInputError(
            f"{where}: up {list(up.shape)} and down {list(down.shape)} do not fit a patch of "
            f"{len(rows)} output rows and {len(cols)} input columns (the layer or its band)"
        )
    factor = float(patch.strength) * float(patch.scale)
    if factor == 0.0:
        return None
    out_dim, in_dim = shape
    rank = down.shape[0]
    first_row = slot.part * out_dim + rows.start
    placed_up = np.zeros((out_dim * slot.parts, rank), np.float32)
    placed_up[first_row : first_row + len(rows)] = up * np.float32(factor)
    placed_down = np.zeros((rank, in_dim), np.float32)
    placed_down[:, cols.start : cols.stop] = down
    return Pair(down=placed_down, up=placed_up)


def patched_tree(tree: dict, grouped: dict[LinearSlot, list[Pair]], dtype: mx.Dtype) -> dict:
    """A shallow copy of the weight tree with each patched weight's concatenated pair beside it
    (the plain weights are shared, never copied); the tree itself when nothing is patched."""
    if not grouped:
        return tree
    patched = copy_along(tree, {slot.path for slot in grouped})
    for slot, pairs in grouped.items():
        node = slot.node(patched)
        node[slot.key + LORA_DOWN] = mx.array(np.concatenate([p.down for p in pairs])).astype(dtype)
        node[slot.key + LORA_UP] = mx.array(np.concatenate([p.up for p in pairs], 1)).astype(dtype)
    return patched


def pair_bytes(tree: Any) -> int:
    """Bytes of the pairs a patched tree carries, wherever in it they sit."""
    if isinstance(tree, list):
        return sum(pair_bytes(child) for child in tree)
    if not isinstance(tree, dict):
        return 0
    return sum(
        value.nbytes if key.endswith((LORA_DOWN, LORA_UP)) else pair_bytes(value)
        for key, value in tree.items()
    )


def table_id(table: Any | None) -> str | None:
    """A patch table's id, for the keys of states made under it (a `service.PatchTable`;
    None: no table)."""
    return None if table is None else table.table_id


class TableWeights:
    """The weight trees of one model instance's patch tables, built on demand from the tables
    and kept least-recently-used within a byte budget (the newest always stays). They die with
    the instance, as its tables do."""

    def __init__(
        self,
        tree: dict,
        slots: dict[str, LinearSlot],
        dtype: mx.Dtype,
        budget_bytes: int = TABLE_BUDGET_BYTES,
        shard: TreeShard | None = None,
    ):
        self.tree = tree
        self.slots = slots
        self.dtype = dtype
        self.shard = shard  # the rank's slice of the tree, when the DiT is sharded
        self.budget_bytes = budget_bytes
        self._trees: OrderedDict[str, tuple[dict, int]] = OrderedDict()

    def check(self, table: Any) -> None:
        """Refuse a table that does not fit this DiT (EngineInputError, answered 400); a table
        that fits is prepared now, so its first step need not."""
        self._prepare(table)

    def weights_for(self, table: Any | None) -> dict:
        """The tree a step runs under: the plain weights, or the table's patched tree."""
        if table is None:
            return self.tree
        held = self._trees.get(table.table_id)
        if held is not None:
            self._trees.move_to_end(table.table_id)
            return held[0]
        return self._prepare(table)

    @property
    def held_bytes(self) -> int:
        return sum(size for _, size in self._trees.values())

    def __len__(self) -> int:
        return len(self._trees)

    def clear(self) -> None:
        self._trees.clear()

    def _prepare(self, table: Any) -> dict:
        grouped = table_pairs(table, self.slots, self.tree, self.shard)
        tree = patched_tree(self.tree, grouped, self.dtype)
        mx.eval([leaf for slot in grouped for leaf in _pair_leaves(tree, slot)])
        self._trees[table.table_id] = (tree, pair_bytes(tree))
        self._trees.move_to_end(table.table_id)
        while self.held_bytes > self.budget_bytes and len(self._trees) > 1:
            self._trees.popitem(last=False)
        return tree


def _pair_leaves(tree: dict, slot: LinearSlot) -> list[mx.array]:
    node = slot.node(tree)
    return [node[slot.key + LORA_DOWN], node[slot.key + LORA_UP]]
