"""GGUF weights held as their file holds them: the raw blocks of llama.cpp's types, decoded by
MLX operations at each matmul.

A weight in this form is a flat uint8 array, the bytes of its rows one after another, and a
`BlockLayout`: its input width and, in row order, its runs of rows of one GGUF type. A fused
weight (q, k and v as one matrix) may mix types: Q4_K_M files store some matrices Q6_K beside
Q4_K ones, and a float part (F16, BF16, F32) is a run too. Nothing is widened, so the weight
holds exactly its file's bytes.

On Metal with the `kquant` extra installed (`mlx-kquant`, the same codecs as Metal kernels),
`matmul` runs its quantized matmul on the bytes as they are. Elsewhere, and on Metal without
it, `decode` turns the bytes into the float matrix with the arithmetic of `gguf.quants.dequantize`
(llama.cpp's reference in Python), step for step in float32, so on the CPU backend it equals
gguf's weights bit for bit for every type (tests/engine/test_ggml_blocks.py). `matmul` decodes
just before the product, as quantize.quantized_matmul dequantizes affine weights on the CPU:
while a linear runs its float matrix is alive, never the float model.

In a weight tree the bytes sit at the weight's key and the layout beside them at key + LAYOUT
(quantize.linear reads both); an `mlx.nn` module (a text encoder) gets `BlockLinear` and
`BlockEmbedding` layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_map_with_path

LAYOUT = ".ggml"  # beside a weight held as blocks: its BlockLayout
# Bytes per weight element a decode holds at its peak: the float32 matrix and half as much
# again of its temporaries (measured on the full-size Qwen-Image 2.1 step, docs/benchmarks.md
# "Full-size memory": the GGUF step's peak over the plan's with the float32 matrix alone).
DECODE_BYTES = 6
QK_K = 256  # the K-quants' super-block


@dataclass(frozen=True)
class BlockLayout:
    """A weight's shape and types: `cols` input columns, and `runs`, (GGUF type, rows) in row
    order (a fused weight's parts; neighbours of one type merged)."""

    cols: int
    runs: tuple[tuple[T, int], ...]

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.runs)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def row_bytes(self, kind: T) -> int:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        return self.cols // block_size * type_size

    @property
    def nbytes(self) -> int:
        return sum(rows * self.row_bytes(kind) for kind, rows in self.runs)

    @property
    def types(self) -> tuple[T, ...]:
        return tuple(dict.fromkeys(kind for kind, _ in self.runs))

    def constants(self) -> tuple[int, ...]:
        """The layout as a weight tree holds it: (cols, type, rows, type, rows, ...), plain
        integers (mx.compile takes them as part of a trace's signature)."""
        return (self.cols, *(int(v) for kind, rows in self.runs for v in (kind, rows)))

    @classmethod
    @functools.cache
    def of(cls, constants: tuple[int, ...]) -> BlockLayout:
        """The layout a tree's constants give (cached: every step's every linear asks)."""
        cols, *flat = constants
        return cls(cols, tuple((T(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)))

    def spans(self):
        """(type, first row, rows, first byte) of each run."""
        row = offset = 0
        for kind, rows in self.runs:
            yield kind, row, rows, offset
            row += rows
            offset += rows * self.row_bytes(kind)


@dataclass(frozen=True)
class Blocks:
    """A weight as its file's blocks, as a GGUF file is read: its bytes (flat uint8) and
    layout."""

    data: mx.array
    layout: BlockLayout


def merged(runs) -> tuple[tuple[T, int], ...]:
    """Runs with neighbours of one type joined (and empty ones dropped)."""
    out: list[tuple[T, int]] = []
    for kind, rows in runs:
        if rows == 0:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + rows)
        else:
            out.append((kind, rows))
    return tuple(out)


def decode(data: mx.array, layout: BlockLayout, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The (rows, cols) float matrix of a weight's bytes, in `dtype` (decoded in float32)."""
    parts = []
    for kind, _, rows, offset in layout.spans():
        size = rows * layout.row_bytes(kind)
        block_size, type_size = GGML_QUANT_SIZES[kind]
        blocks = data[offset : offset + size].reshape(-1, type_size)
        parts.append(_DECODERS[kind](blocks).reshape(rows, layout.cols))
    matrix = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    return matrix if matrix.dtype == dtype else matrix.astype(dtype)


def matmul(x: mx.array, data: mx.array, layout: BlockLayout) -> mx.array:
    """x W^T for a weight held as blocks: on Metal with `mlx-kquant` installed, its quantized
    kernels run on the blocks as they are (`kquant_matmul`); else W decoded at x's dtype,
    then the float GEMM."""
    if on_metal() and kquant_codecs(layout) is not None:
        return kquant_matmul(x, data, layout)
    # Not before x: MLX evaluates ready nodes breadth-first, and a decode that hangs on the
    # weights alone would run ahead with every other, all float weights alive at once.
    (data,) = mx.depends([data], [x])
    return x @ decode(data, layout, x.dtype).T


def on_metal() -> bool:
    return mx.default_device() == mx.gpu and mx.metal.is_available()


@functools.cache
def kquant():
    """`mlx_kquant` (the optional extra: Metal kernels for llama.cpp's codecs), or None."""
    try:
        import mlx_kquant
    except ImportError:
        return None
    return mlx_kquant


@functools.cache
def kquant_codecs(layout: BlockLayout) -> tuple[str, ...] | None:
    """mlx-kquant's codec of each run (llama.cpp's type names, lower case), or None when the
    extra is absent or a run is of a type it has no codec for (the float ones)."""
    extra = kquant()
    if extra is None:
        return None
    codecs = tuple(kind.name.lower() for kind in layout.types)
    known = set(extra.codecs())
    return codecs if all(codec in known for codec in codecs) else None


def kquant_matmul(x: mx.array, data: mx.array, layout: BlockLayout) -> mx.array:
    """x W^T by mlx-kquant's `quantized_matmul`, one run of rows at a time (its output rows
    joined), on the blocks as the file holds them (the codecs keep their scales inside the
    bytes; the `scales` argument is the extra's placeholder)."""
    extra = kquant()
    placeholder = _constant((0,), mx.uint8)
    outs = []
    for kind, _, rows, offset in layout.spans():
        width = layout.row_bytes(kind)
        part = data[offset : offset + rows * width].reshape(rows, width)
        codec = kind.name.lower()
        outs.append(extra.quantized_matmul(x, part, placeholder, codec, transpose=True))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def sanitize_blocks(files: dict, sanitize) -> dict:
    """The weight tree of files whose linear weights may be held as blocks (`files`: name ->
    array or Blocks), through the family's own
    `sanitize`, which may concatenate linear weights along their rows only (the bytes of
    whole rows follow one another, so that is a concatenation of the flat bytes): each weight
    held as blocks gets its layout beside it (key + LAYOUT), its runs found by passing each
    row's type through the same sanitize."""
    blocked = {name for name, value in files.items() if isinstance(value, Blocks)}
    plain = {n: files[n].data if n in blocked else v for n, v in files.items()}
    kinds = {n: _row_kinds(files[n].layout) if n in blocked else v for n, v in files.items()}
    tree = sanitize(plain)
    _attach_layouts(tree, sanitize(kinds))
    return tree


def _row_kinds(layout: BlockLayout) -> mx.array:
    """(rows, 2) int32: each row's GGUF type and the weight's columns."""
    kinds = np.concatenate([np.full(rows, int(kind)) for kind, rows in layout.runs])
    return mx.array(np.stack([kinds, np.full_like(kinds, layout.cols)], axis=1).astype(np.int32))


def _runs(kinds: np.ndarray) -> tuple[tuple[T, int], ...]:
    """Each row's type -> (type, rows) runs."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(kinds)) + 1, [len(kinds)]])
    return tuple(
        (T(int(kinds[a])), int(b - a)) for a, b in zip(starts[:-1], starts[1:], strict=True)
    )


def _attach_layouts(tree, kinds) -> None:
    if isinstance(tree, list):
        for index, child in enumerate(tree):
            _attach_layouts(child, kinds[index])
        return
    for key in list(tree):
        value = tree[key]
        if isinstance(value, (dict, list)):
            _attach_layouts(value, kinds[key])
        elif isinstance(value, mx.array) and value.dtype == mx.uint8:
            rows = np.array(kinds[key])
            cols = {int(c) for c in rows[:, 1]}
            if len(cols) != 1:
                raise ValueError(f"{key}: parts of {sorted(cols)} columns fused into one weight")
            tree[key + LAYOUT] = BlockLayout(cols.pop(), _runs(rows[:, 0])).constants()


# ---------------------------------------------------------------------------------------------
# Cutting a weight's rows and columns (a rank's shard), on the host side of the layout


def take_rows(
    data: mx.array, layout: BlockLayout, rows: np.ndarray
) -> tuple[mx.array, BlockLayout]:
    """The bytes and layout of the given rows (ascending) of a weight."""
    pieces, runs = [], []
    for kind, first, count, offset in layout.spans():
        picked = rows[(rows >= first) & (rows < first + count)] - first
        if picked.size == 0:
            continue
        width = layout.row_bytes(kind)
        part = data[offset : offset + count * width].reshape(count, width)
        pieces.append(part[mx.array(picked)].reshape(-1))
        runs.append((kind, int(picked.size)))
    return _joined(pieces), BlockLayout(layout.cols, merged(runs))


def take_columns(
    data: mx.array, layout: BlockLayout, start: int, stop: int
) -> tuple[mx.array, BlockLayout] | None:
    """The bytes and layout of input columns [start, stop) of a weight, or None when they do not
    fall on whole blocks of every run."""
    pieces = []
    for kind, _, count, offset in layout.spans():
        block_size, type_size = GGML_QUANT_SIZES[kind]
        if start % block_size or stop % block_size:
            return None
        width = layout.row_bytes(kind)
        part = data[offset : offset + count * width].reshape(count, width)
        lo, hi = start // block_size * type_size, stop // block_size * type_size
        pieces.append(part[:, lo:hi].reshape(-1))
    return _joined(pieces), BlockLayout(stop - start, layout.runs)


def _joined(pieces: list[mx.array]) -> mx.array:
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)


# ---------------------------------------------------------------------------------------------
# The types: (n, type size) uint8 blocks -> (n, block size) float32, as gguf.quants computes


@functools.cache
def _constant(values: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A small constant array, made once (the decoders' shifts, built at every matmul else)."""
    return mx.array(values, dtype)


def _f16(blocks: mx.array, start: int) -> mx.array:
    """(n, 1) float32 of the float16 at byte `start` of each block."""
    return blocks[:, start : start + 2].view(mx.float16).astype(mx.float32)


def _shifted(qs: mx.array, run: int, shifts: tuple[int, ...]) -> mx.array:
    """(n, k) bytes -> (n, k / run, len(shifts), run): each run of `run` bytes shifted right by
    each of `shifts` (the order in which llama.cpp packs 4-, 2- and 1-bit fields)."""
    n = qs.shape[0]
    by = _constant(shifts, mx.uint8).reshape(1, 1, len(shifts), 1)
    return qs.reshape(n, -1, 1, run) >> by


def _nibbles(qs: mx.array, run: int) -> mx.array:
    """(n, k) bytes -> (n, 2k) levels: per run of `run` bytes, the low nibbles then the high."""
    return (_shifted(qs, run, (0, 4)) & 0x0F).reshape(qs.shape[0], -1)


def _bits32(word: mx.array) -> mx.array:
    """(n, 4) bytes -> (n, 32) uint8: bit j of the little-endian word, for j = 0..31."""
    word = word.view(mx.uint32)
    return ((word >> _constant(tuple(range(32)), mx.uint32)[None, :]) & 1).astype(mx.uint8)


def _float(kind: mx.Dtype):
    def decode_float(blocks: mx.array) -> mx.array:
        return blocks.view(kind).astype(mx.float32)

    return decode_float


def _q8_0(b):
    return b[:, 2:].view(mx.int8).astype(mx.float32) * _f16(b, 0)


def _q4_0(b):
    q = _nibbles(b[:, 2:], 16).astype(mx.int8) - 8
    return _f16(b, 0) * q.astype(mx.float32)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:], 16).astype(mx.float32) + _f16(b, 2)


def _q5_0(b):
    q = (_nibbles(b[:, 6:], 16) | (_bits32(b[:, 2:6]) << 4)).astype(mx.int8) - 16
    return _f16(b, 0) * q.astype(mx.float32)


def _q5_1(b):
    q = (_nibbles(b[:, 8:], 16) | (_bits32(b[:, 4:8]) << 4)).astype(mx.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    dl = (_f16(b, 80) * (scales & 0x0F).astype(mx.float32)).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).astype(mx.float32)).reshape(n, 16, 1)
    q = (_shifted(qs, 32, (0, 2, 4, 6)) & 3).reshape(n, 16, 16).astype(mx.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = (_shifted(packed[:, :8], 8, (0, 4))).reshape(n, 16)
    high = (_shifted(packed[:, 8:12], 4, (0, 2, 4, 6))).reshape(n, 16)
    scales = (low & 0x0F) | ((high & 0x03) << 4)
    scales = (scales.astype(mx.int8) - 32).astype(mx.float32)
    dl = (_f16(b, 108) * scales).reshape(n, 16, 1)
    ql = _shifted(qs, 32, (0, 2, 4, 6)).reshape(n, 16, 16) & 3
    qh = (_shifted(hmask, 32, tuple(range(8))).reshape(n, 16, 16) & 1) ^ 1
    q = (ql.astype(mx.int8) - (qh << 2).astype(mx.int8)).astype(mx.float32)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(packed: mx.array) -> tuple[mx.array, mx.array]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (n, 8) each (gguf's get_scale_min)."""
    n = packed.shape[0]
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = mx.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = mx.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mins.reshape(n, 8)


def _k_affine(b):
    """Q4_K/Q5_K's per-32 scales d·sc and offsets dmin·m, (n, 8, 1) each."""
    n = b.shape[0]
    sc, mins = _k_scale_min(b[:, 4:16])
    scale = (_f16(b, 0) * sc.astype(mx.float32)).reshape(n, 8, 1)
    offset = (_f16(b, 2) * mins.astype(mx.float32)).reshape(n, 8, 1)
    return scale, offset


def _q4_k(b):
    n = b.shape[0]
    scale, offset = _k_affine(b)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).astype(mx.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    scale, offset = _k_affine(b)
    low = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    high = (_shifted(b[:, 16:48], 32, tuple(range(8))) & 1).reshape(n, 8, 32)
    q = (low | (high << 4)).astype(mx.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].view(mx.int8).astype(mx.float32)
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    low = (_shifted(ql, 64, (0, 4)) & 0x0F).reshape(n, -1, 32)
    high = (_shifted(qh, 32, (0, 2, 4, 6)) & 3).reshape(n, -1, 32)
    q = ((low | (high << 4)).astype(mx.int8) - 32).reshape(n, 16, 16).astype(mx.float32)
    return (d * q).reshape(n, QK_K)


_DECODERS = {
    T.F32: _float(mx.float32),
    T.F16: _float(mx.float16),
    T.BF16: _float(mx.bfloat16),
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}


# ---------------------------------------------------------------------------------------------
# Layers of an mlx.nn module


class BlockLinear(nn.Module):
    """A linear layer whose weight is held as GGUF blocks (`weight`: its bytes; `layout`)."""

    def __init__(self, layout: BlockLayout, bias: bool):
        super().__init__()
        object.__setattr__(self, "layout", layout)
        self.weight = mx.zeros((layout.nbytes,), mx.uint8)
        if bias:
            self.bias = mx.zeros((layout.rows,))

    def __call__(self, x: mx.array) -> mx.array:
        out = matmul(x, self["weight"], self.layout)
        return out + self["bias"] if "bias" in self else out


class BlockEmbedding(nn.Module):
    """A token table held as GGUF blocks of one type: the rows looked up are decoded."""

    def __init__(self, layout: BlockLayout):
        super().__init__()
        if len(layout.runs) != 1:
            raise ValueError("a token table's rows are of one GGUF type")
        object.__setattr__(self, "layout", layout)
        self.weight = mx.zeros((layout.nbytes,), mx.uint8)

    def __call__(self, ids: mx.array) -> mx.array:
        ((kind, rows),) = self.layout.runs
        table = self["weight"].reshape(rows, self.layout.row_bytes(kind))
        picked = table[ids.reshape(-1)].reshape(-1)
        count = int(np.prod(ids.shape))
        matrix = decode(picked, BlockLayout(self.layout.cols, ((kind, count),)))
        return matrix.reshape(*ids.shape, self.layout.cols)


def hold_blocks(module: nn.Module, weights: dict) -> None:
    """Make the module's layers whose weight is `Blocks` (module_files.ModuleFiles) `BlockLinear` or
    `BlockEmbedding` layers, and put the bytes in the weights' place, ready for
    `load_weights`."""

    def swap(path: str, layer: nn.Module) -> nn.Module:
        value = weights.get(path + ".weight")
        if not isinstance(value, Blocks):
            return layer
        weights[path + ".weight"] = value.data
        if isinstance(layer, nn.Embedding):
            return BlockEmbedding(value.layout)
        return BlockLinear(value.layout, bias="bias" in layer)

    leaves = tree_map_with_path(swap, module.leaf_modules(), is_leaf=nn.Module.is_module)
    module.update_modules(leaves)
