"""GGUF model files (llama.cpp's format, as ComfyUI-GGUF and others ship DiTs in it) as MLX
weights, read with the `gguf` package (llama.cpp's own reader), one tensor at a time from the
memory-mapped file: the whole model is never held in float. A DiT's single safetensors file
(ComfyUI's `diffusion_models`, in its checkpoint's own naming) is read the same way
(`SafetensorsFile`), so `DiTFile` maps either onto the family's names.

A tensor's GGUF shape lists the input dimension first; here shapes are row-major (out, in), and
a `comfy.gguf.orig_shape.<name>` entry (ComfyUI-GGUF's convert script flattens some tensors to
rows of 256) restores the original. Names may sit under `model.diffusion_model.` or
`diffusion_model.`, which `GGUFFile` strips.

Types, and what a tensor of each becomes (`read`):
- F32, F16, BF16: a float array.
- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32: one scale d, and a min m or a fixed offset) and
  Q4_K, Q5_K (super-blocks of 256 whose eight sub-blocks of 32 carry a 6-bit scale and min):
  MLX's affine quantization at group 32 with float32 scales and biases, exactly: w = s·q + b
  with s = d (K: d·sc) and b = m, −8·d, −16·d, −128·d (K: −dmin·m), so `mx.dequantize` equals
  `gguf.quants.dequantize` bit for bit in float32 (tests/engine/test_gguf.py).
- Q6_K, Q3_K, Q2_K (sub-blocks of 16, below MLX's smallest group of 32): no exact MLX form;
  dequantized by `gguf.quants.dequantize` and quantized again by `mx.quantize` at NEAREST's
  width, group 32. The error that adds is measured in docs/benchmarks.md ("GGUF types").
Any other type is refused, naming the tensor.
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import safetensors
from gguf import GGMLQuantizationType as T

from .precision import MODE
from .quantize import BIASES, SCALES

GROUP_SIZE = 32
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
ORIG_SHAPE = "comfy.gguf.orig_shape."
ARCHITECTURE = "general.architecture"
FLOAT_TYPES = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}
# The types held as MLX affine quantization without loss, and their width.
EXACT = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q4_K: 4, T.Q5_K: 5}
# The types with no exact MLX form, and the width they are quantized again at.
NEAREST = {T.Q6_K: 8, T.Q3_K: 5, T.Q2_K: 4}
ROWS_PER_CHUNK = 256  # rows converted at once, bounding a conversion's numpy temporaries


class GGUFError(ValueError):
    """A GGUF file (or a DiT's single safetensors file) that cannot be read as the model's
    weights; the text names the file (and the tensor)."""


@dataclass(frozen=True)
class Quantized:
    """One weight in MLX's affine form at group GROUP_SIZE: the integer levels q (rows, cols),
    uint8, and float32 scales and biases (rows, cols / GROUP_SIZE); w = scales * q + biases."""

    q: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int

    def packed(self, bits: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """(packed uint32, scales, biases) at `bits` (default: its own width; a wider one holds
        the same levels, so widening is exact)."""
        bits = self.bits if bits is None else bits
        if bits < self.bits:
            raise ValueError(f"cannot pack {self.bits}-bit levels in {bits} bits")
        return mx.array(pack(self.q, bits)), mx.array(self.scales), mx.array(self.biases)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Levels (rows, cols) < 2**bits as MLX packs them: one little-endian bit stream per row
    (level j at bits j*bits ...), read as uint32 words (rows, cols * bits / 32)."""
    rows, cols = q.shape
    per_word = 8 // np.gcd(8, bits)  # levels that fill whole bytes
    groups = q.reshape(rows, cols // per_word, per_word).astype(np.uint64)
    shifts = (np.arange(per_word, dtype=np.uint64) * np.uint64(bits))[None, None, :]
    words = np.bitwise_or.reduce(groups << shifts, axis=-1)  # each < 2**(per_word*bits) <= 2**40
    width = per_word * bits // 8
    stream = words[..., None].view(np.uint8)[..., :width]  # little-endian: low bytes first
    return np.ascontiguousarray(stream).reshape(rows, -1).view(np.uint32)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """The levels of `pack`'s words, uint8 (rows, cols)."""
    rows = packed.shape[0]
    stream = np.unpackbits(packed.view(np.uint8).reshape(rows, -1), axis=-1, bitorder="little")
    stream = stream.reshape(rows, -1, bits)
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (stream * weights).sum(axis=-1, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# The exact types: block bytes -> levels, scales and biases (mirroring gguf.quants' layouts)


def _half(raw: np.ndarray) -> np.ndarray:
    """(n, 2) bytes -> (n, 1) float32 of the float16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """(n, k) bytes -> (n, 2 * k / run, run) levels: per run of `run` bytes, the low nibbles
    then the high ones (the order of Q4_0's 16 bytes, Q4_K's 32-byte chunks)."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(n, -1, run)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes -> (n, 32) fifth bits (element j: bit j of the little-endian word)."""
    word = np.ascontiguousarray(qh).view(np.uint32)
    return ((word >> np.arange(count, dtype=np.uint32)[None, :]) & 1).astype(np.uint8)


def _q8_0(b):
    d = _half(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _q4_0(b):
    d = _half(b[:, :2])
    return _nibbles(b[:, 2:], 16).reshape(-1, 32), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:], 16).reshape(-1, 32), _half(b[:, :2]), _half(b[:, 2:4])


def _q5_0(b):
    d = _half(b[:, :2])
    q = _nibbles(b[:, 6:], 16).reshape(-1, 32) | (_high_bits(b[:, 2:6], 32) << 4)
    return q, d, -16 * d


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16).reshape(-1, 32) | (_high_bits(b[:, 4:8], 32) << 4)
    return q, _half(b[:, :2]), _half(b[:, 2:4])


def _k_scales(b):
    """Q4_K/Q5_K's super-block header -> scales d·sc and biases −dmin·m per sub-block (n, 8)."""
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    scales = _half(b[:, :2]) * sc.astype(np.float32)
    return scales, -(_half(b[:, 2:4]) * m.astype(np.float32))


def _q4_k(b):
    scales, biases = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scales, biases


def _q5_k(b):
    scales, biases = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _nibbles(b[:, 48:], 32) | ((qh & 1) << 4), scales, biases


_EXACT_BLOCKS = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
}


def affine(kind: T, data: np.ndarray, rows: int, cols: int) -> Quantized:
    """A quantized tensor's bytes (rows, bytes per row) in MLX's affine form at group 32:
    exact for EXACT's types, quantized again at NEAREST's width for the others."""
    if kind in EXACT:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        convert = _EXACT_BLOCKS[kind]
        parts = [convert(chunk.reshape(-1, type_size)) for chunk in _row_chunks(data)]
        q = np.concatenate([p[0].reshape(-1, cols) for p in parts])
        scales = np.concatenate([p[1].reshape(-1, cols // GROUP_SIZE) for p in parts])
        biases = np.concatenate([p[2].reshape(-1, cols // GROUP_SIZE) for p in parts])
        return Quantized(q, scales, biases, EXACT[kind])
    bits = NEAREST[kind]
    levels, all_scales, all_biases = [], [], []
    for chunk in _row_chunks(data):
        values = mx.array(gguf.quants.dequantize(chunk, kind).reshape(-1, cols))
        packed, scales, biases = mx.quantize(values, GROUP_SIZE, bits, mode=MODE)
        levels.append(unpack(np.array(packed), bits))
        all_scales.append(np.array(scales, np.float32))
        all_biases.append(np.array(biases, np.float32))
    return Quantized(
        np.concatenate(levels), np.concatenate(all_scales), np.concatenate(all_biases), bits
    )


def _row_chunks(data: np.ndarray):
    for start in range(0, data.shape[0], ROWS_PER_CHUNK):
        yield np.asarray(data[start : start + ROWS_PER_CHUNK])


# ---------------------------------------------------------------------------------------------
# The file


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the file under its name less the prefix: its type and row-major shape."""

    name: str
    kind: T
    shape: tuple[int, ...]
    tensor: gguf.ReaderTensor

    @property
    def type_name(self) -> str:
        return self.kind.name

    @property
    def quantized(self) -> bool:
        return self.kind not in FLOAT_TYPES

    @property
    def stored_2d(self) -> bool:
        """Whether the stored rows are the logical rows (no orig_shape reshape)."""
        stored = tuple(int(v) for v in reversed(self.tensor.shape.tolist()))
        return len(self.shape) == 2 and stored == self.shape

    @property
    def nbytes(self) -> int:
        return int(self.tensor.n_bytes)


class GGUFFile:
    """A GGUF file opened for reading (memory-mapped). A file that is not GGUF, is cut short,
    or holds a tensor of a type this server does not read is refused (GGUFError), naming the
    file and the tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            reader = _Reader(self.path)
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise GGUFError(f"{self.path} is not a readable GGUF file: {exc}") from None
        field = reader.get_field(ARCHITECTURE)
        self.architecture = None if field is None else field.contents()
        prefix = common_prefix([tensor.name for tensor in reader.tensors])
        self.entries: dict[str, TensorEntry] = {}
        for tensor in reader.tensors:
            kind = tensor.tensor_type
            if kind not in FLOAT_TYPES and kind not in EXACT and kind not in NEAREST:
                raise GGUFError(
                    f"{self.path}: tensor {tensor.name} is {kind.name}, which this server does"
                    f" not read (it reads {', '.join(readable_types())})"
                )
            name = tensor.name[len(prefix) :]
            self.entries[name] = TensorEntry(name, kind, _shape(reader, tensor), tensor)
        # the memory map gguf's reader reads through (np.memmap's own mmap object)
        self._mapping = getattr(reader.data, "_mmap", None)

    def read(
        self, name: str, dtype: mx.Dtype | None = None, as_float: bool = False
    ) -> mx.array | Quantized:
        """Tensor `name`: its affine form when it is quantized and stored in its logical rows
        (and not `as_float`), else a float array (a quantized one dequantized by gguf,
        exactly), cast to `dtype` when given."""
        entry = self.entries[name]
        data = entry.tensor.data
        if entry.quantized and entry.stored_2d and not as_float:
            value = affine(entry.kind, data, *entry.shape)
            self._release_pages(entry)
            return value
        if entry.kind == T.BF16:
            value = mx.array(np.ascontiguousarray(data).view(np.uint16)).view(mx.bfloat16)
        elif entry.quantized:
            value = mx.array(gguf.quants.dequantize(np.asarray(data), entry.kind))
        else:
            value = mx.array(np.asarray(data))
        self._release_pages(entry)
        value = value.reshape(entry.shape)
        return value if dtype is None else value.astype(dtype)

    def _release_pages(self, entry: TensorEntry) -> None:
        """Drop a tensor's pages of the file from this process's resident set once they are
        read (every read above copies them into MLX or numpy arrays first). The mapping is
        read-only and shared, so the pages are the file's, clean: the kernel keeps them in its
        page cache and maps them again on a later read. Without this a load's RSS counts the
        whole file on top of what it holds (docs/benchmarks.md, "The load of a GGUF DiT")."""
        if self._mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(entry.tensor.data_offset)
        begin = start - start % mmap.PAGESIZE
        self._mapping.madvise(mmap.MADV_DONTNEED, begin, start + entry.nbytes - begin)

    def type_counts(self) -> dict[str, int]:
        """How many tensors the file holds of each type, by GGUF type name."""
        counts: dict[str, int] = {}
        for entry in self.entries.values():
            counts[entry.type_name] = counts.get(entry.type_name, 0) + 1
        return dict(sorted(counts.items()))

    def status(self) -> dict:
        """The file's precision as status reports it: its name and its tensors' types."""
        return {"format": "gguf", "file": self.path.name, "types": self.type_counts()}


def readable_types() -> list[str]:
    return [kind.name for kind in (*FLOAT_TYPES, *EXACT, *NEAREST)]


def common_prefix(names: list[str]) -> str:
    """The one of PREFIXES every name starts with, else ""."""
    return next((p for p in PREFIXES if names and all(n.startswith(p) for n in names)), "")


def _shape(reader: gguf.GGUFReader, tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """The tensor's row-major shape: its orig_shape entry's, else its GGUF shape reversed."""
    field = reader.get_field(ORIG_SHAPE + tensor.name)
    if field is None:
        return tuple(int(v) for v in reversed(tensor.shape.tolist()))
    return tuple(int(v) for v in field.contents())


class _Reader(gguf.GGUFReader):
    """gguf's reader, which first checks that every tensor's data lies inside the file, so a
    file cut short is refused naming the first tensor it cuts (the reader itself fails on a
    reshape that names nothing)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block_size, type_size = gguf.GGML_QUANT_SIZES[T(int(raw_type[0]))]
            size = int(np.prod(dims, dtype=np.int64)) * type_size // block_size
            end = start_offs + int(offset[0]) + size
            if end > len(self.data):
                raise ValueError(
                    f"it is cut short: tensor {bytes(name).decode()} ends at byte {end},"
                    f" the file holds {len(self.data)}"
                )
        super()._build_tensors(start_offs, fields)


# ---------------------------------------------------------------------------------------------
# A DiT's single safetensors file, read as a GGUF file is

SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_FLOATS = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


@dataclass(frozen=True)
class SafetensorsEntry:
    """A float tensor of a safetensors file under its name less the prefix (TensorEntry's
    reading interface: never quantized)."""

    name: str
    type_name: str
    shape: tuple[int, ...]

    quantized = False
    stored_2d = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * SAFETENSORS_FLOATS[self.type_name].size


class SafetensorsFile:
    """A DiT's single safetensors file (a checkpoint in its own naming, as ComfyUI's
    `diffusion_models` hold it) with GGUFFile's reading interface: names less the prefix
    (PREFIXES), float tensors only (F32, F16, BF16: any other dtype, such as a float8
    checkpoint's, is refused naming the tensor), each read on its own (`mx.load` is lazy)."""

    architecture = None

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with safetensors.safe_open(str(self.path), "numpy") as handle:
                header = {n: handle.get_slice(n) for n in handle.keys()}
                stored = {n: (s.get_dtype(), tuple(s.get_shape())) for n, s in header.items()}
        except (OSError, safetensors.SafetensorError) as exc:
            raise GGUFError(f"{self.path} is not a readable safetensors file: {exc}") from None
        self.prefix = common_prefix(list(stored))
        self.entries: dict[str, SafetensorsEntry] = {}
        for file_name, (dtype, shape) in stored.items():
            if dtype not in SAFETENSORS_FLOATS:
                raise GGUFError(
                    f"{self.path}: tensor {file_name} is stored as {dtype}; a DiT's safetensors"
                    f" file must hold {', '.join(SAFETENSORS_FLOATS)} tensors"
                )
            name = file_name[len(self.prefix) :]
            self.entries[name] = SafetensorsEntry(name, dtype, shape)
        self._arrays: dict[str, mx.array] | None = None

    def read(self, name: str, dtype: mx.Dtype | None = None, as_float: bool = True) -> mx.array:
        """Tensor `name` (a float array), cast to `dtype` when given."""
        if self._arrays is None:
            self._arrays = mx.load(str(self.path))
        value = self._arrays[self.prefix + name]
        return value if dtype is None or value.dtype == dtype else value.astype(dtype)

    def status(self) -> None:
        """Float weights, as a folder's: no quantization to report."""
        return None


def weights_file(path: Path) -> GGUFFile | SafetensorsFile:
    """A DiT's single weights file, by its suffix: `.safetensors` or GGUF."""
    if Path(path).suffix.lower() == SAFETENSORS_SUFFIX:
        return SafetensorsFile(path)
    return GGUFFile(path)


# ---------------------------------------------------------------------------------------------
# A DiT's weights in one file (GGUF or safetensors), named as the family names them


@dataclass(frozen=True)
class Naming:
    """Another naming of a DiT's tensors that a file may use (ComfyUI's, BFL's), onto the
    family's diffusers names: `renames` (regular expression, replacement), applied in order,
    and `fused`, file tensors (by name suffix, after the renames) whose rows split into several
    diffusers tensors (suffixes, in row order). The renames must leave a diffusers name as it
    is, so a file in either naming (or a mix) reads the same. `ignored`: file tensors the
    forward does not read. `swapped`: file tensors (by their own names) whose two halves of
    rows the file holds in the other order than diffusers (BFL's final modulation: shift, then
    scale); swapping them permutes whole rows, which quantized rows allow."""

    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    ignored: tuple[str, ...] = ()
    swapped: tuple[str, ...] = ()

    def sources(self, names) -> dict[str, tuple[str, int, int]]:
        """Diffusers name -> (file name, part, parts): which rows of which file tensor it is."""
        found: dict[str, tuple[str, int, int]] = {}
        for file_name in names:
            name = self.renamed(file_name)
            if name in self.ignored:
                continue
            for suffix, parts in self.fused:
                if name.endswith(suffix):
                    stem = name[: -len(suffix)]
                    for part, part_suffix in enumerate(parts):
                        found[stem + part_suffix] = (file_name, part, len(parts))
                    break
            else:
                found[name] = (file_name, 0, 1)
        return found

    def renamed(self, file_name: str) -> str:
        for pattern, replacement in self.renames:
            file_name = re.sub(pattern, replacement, file_name)
        return file_name

    def holds(self, names) -> bool:
        """Whether any of `names` is in this naming rather than diffusers' (renamed, or fused)."""
        fused = tuple(suffix for suffix, _ in self.fused)
        for name in names:
            renamed = self.renamed(name)
            if renamed != name or renamed.endswith(fused):
                return True
        return False


@dataclass(frozen=True)
class DiTFile:
    """A family's DiT read from one file, GGUF or safetensors (`weights_file`, by its suffix):
    `shapes`, every tensor the family's config asks for by diffusers name (its logical shape);
    `fused`, diffusers weight name -> the names of the weight its forward fuses it with
    (linear_slots' parts, in order); `title`, the family's name in prose. `open` checks the
    whole file against them before anything loads."""

    path: Path
    naming: Naming
    shapes: dict[str, tuple[int, ...]]
    fused: dict[str, tuple[str, ...]]
    title: str

    def open(self) -> tuple[GGUFFile | SafetensorsFile, dict[str, tuple[str, int, int]]]:
        """The file and each expected tensor's source; a GGUFError names the file and the
        tensor when it cannot be read, is not the family's, or holds a shape the config does
        not give."""
        file = weights_file(self.path)
        sources = self.naming.sources(file.entries)
        missing = [name for name in self.shapes if name not in sources]
        if missing:
            arch = f" (its architecture: {file.architecture})" if file.architecture else ""
            raise GGUFError(
                f"{self.path} is not a {self.title} DiT{arch}: it has no tensor {missing[0]}"
                f" ({len(missing)} of the {len(self.shapes)} the family reads are missing)"
            )
        for name, expected in self.shapes.items():
            file_name, part, parts = sources[name]
            shape = _part_shape(file.entries[file_name].shape, parts)
            if shape != tuple(expected):
                raise GGUFError(
                    f"{self.path}: tensor {file_name} has shape {list(file.entries[file_name].shape)}"
                    f" where {self.title}'s config gives {name} the shape {list(expected)}"
                    + (f" ({parts} of them fused along the rows)" if parts > 1 else "")
                )
        return file, sources

    def tensors(
        self, dtype: mx.Dtype | None = None, keep_f32=None, reads=None
    ) -> dict[str, mx.array]:
        """The family's tensors by diffusers name, as a stored quantized folder holds them: a
        linear weight `X.weight` quantized in the file is packed beside `X.scales` and
        `X.biases` (group 32, float32), every part of a fused weight at the widest part's
        width (widening is exact) or, when a part is float, all in float; everything else is a
        float array cast to `dtype` (float32 for the names `keep_f32` picks). Read one file
        tensor at a time; a file tensor none of whose names `reads` picks (the blocks of
        another rank: shard.TreeShard.reads) is never read: its names hold zeros of their
        shapes that are never evaluated (MLX arrays are lazy), for the caller to drop."""
        file, sources = self.open()
        widths = self._widths(file, sources)
        out: dict[str, mx.array] = {}
        by_file: dict[str, list[tuple[str, int, int]]] = {}
        for name in self.shapes:
            file_name, part, parts = sources[name]
            by_file.setdefault(file_name, []).append((name, part, parts))
        for file_name, targets in by_file.items():
            float_dtype = dtype
            if keep_f32 is not None and all(keep_f32(name) for name, _, _ in targets):
                float_dtype = mx.float32
            swapped = file_name in self.naming.swapped
            kept_quantized = all(name in widths for name, _, _ in targets)
            if reads is not None and not any(reads(name) for name, _, _ in targets):
                for name, _, _ in targets:
                    width = widths[name] if kept_quantized else None
                    out.update(self._unread(name, width, float_dtype))
                continue
            if kept_quantized:
                value = file.read(file_name)
                value = _swapped_rows(value) if swapped else value
                for name, part, parts in targets:
                    base = name[: -len(".weight")]
                    packed = _rows(value, part, parts).packed(widths[name])
                    out[name], out[base + SCALES], out[base + BIASES] = packed
            else:
                value = file.read(file_name, float_dtype, as_float=True)
                value = _swapped_halves(value) if swapped else value
                for name, part, parts in targets:
                    out[name] = _split_rows(value, part, parts)
            del value
        return out

    def _unread(self, name: str, width: int | None, dtype: mx.Dtype | None) -> dict:
        """Lazy zeros in place of a tensor that is not read: packed at `width` with its scales
        and biases (a weight kept quantized), else a float array."""
        shape = tuple(self.shapes[name])
        if width is None:
            return {name: mx.zeros(shape, dtype or mx.float32)}
        rows, cols = shape
        base = name[: -len(".weight")]
        return {
            name: mx.zeros((rows, cols * width // 32), mx.uint32),
            base + SCALES: mx.zeros((rows, cols // GROUP_SIZE), mx.float32),
            base + BIASES: mx.zeros((rows, cols // GROUP_SIZE), mx.float32),
        }

    def _widths(self, file: GGUFFile, sources) -> dict[str, int]:
        """Diffusers weight name -> the width it is packed at, for the weights kept quantized:
        those whose every fused part is quantized in its logical rows."""
        widths: dict[str, int] = {}
        for name, group in self.fused.items():
            entries = [file.entries[sources[part][0]] for part in group]
            if all(entry.quantized and entry.stored_2d for entry in entries):
                widths[name] = max(_width(entry.kind) for entry in entries)
        return widths

    def infos(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(diffusers name, logical shape, stored type) of every tensor the family reads:
        "quant" for a quantized one, else F32, F16 or BF16 (the manifest's dtypes)."""
        file, sources = self.open()
        out = []
        for name, shape in self.shapes.items():
            entry = file.entries[sources[name][0]]
            out.append((name, tuple(shape), "quant" if entry.quantized else entry.type_name))
        return out

    def status(self) -> dict | None:
        """The component's precision as status reports it: a GGUF file and its tensors' types;
        None for a safetensors file (float, as a folder's)."""
        return weights_file(self.path).status()

    def stored_bytes(self) -> int:
        """Bytes of tensor data in the file."""
        return sum(entry.nbytes for entry in weights_file(self.path).entries.values())

    def estimated_bytes(self, itemsize: int) -> int:
        """The bytes the family's tensors take loaded (for the status of a model not loaded):
        a weight kept quantized (`tensors`: a linear weight whose every fused part the file
        quantizes) at its MLX width plus float32 scale and bias per group, the rest (a
        quantized tensor that is no linear weight too) at `itemsize` bytes per element."""
        file, sources = self.open()
        widths = self._widths(file, sources)
        total = 0
        for name, shape in self.shapes.items():
            elements = int(np.prod(shape, dtype=np.int64))
            if name in widths:
                total += elements * (widths[name] + 2 * 32 // GROUP_SIZE) // 8
            else:
                total += elements * itemsize
        return total


def _width(kind: T) -> int:
    return EXACT.get(kind) or NEAREST[kind]


def _part_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    if parts == 1:
        return tuple(shape)
    return (shape[0] // parts, *shape[1:]) if shape[0] % parts == 0 else tuple(shape)


def _rows(item: Quantized, part: int, parts: int) -> Quantized:
    """Part `part` of `parts` equal row groups of an affine form."""
    if parts == 1:
        return item
    size = item.q.shape[0] // parts
    rows = slice(part * size, (part + 1) * size)
    return Quantized(item.q[rows], item.scales[rows], item.biases[rows], item.bits)


def _swapped_rows(item: Quantized) -> Quantized:
    """An affine form with its two halves of rows swapped."""
    half = item.q.shape[0] // 2

    def swap(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a[half:], a[:half]])

    return Quantized(swap(item.q), swap(item.scales), swap(item.biases), item.bits)


def _swapped_halves(value: mx.array) -> mx.array:
    first, second = mx.split(value, 2, axis=0)
    return mx.concatenate([second, first], axis=0)


def _split_rows(value: mx.array, part: int, parts: int) -> mx.array:
    if parts == 1:
        return value
    size = value.shape[0] // parts
    return value[part * size : (part + 1) * size]


def fused_weights(slots: dict) -> dict[str, tuple[str, ...]]:
    """Linear weight name -> the weight names its forward fuses it with, in row order, from a
    DiT's `linear_slots` (manifest name -> lora.LinearSlot)."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for name, slot in slots.items():
        groups.setdefault((slot.path, slot.key), []).append((slot.part, name + ".weight"))
    fused = {}
    for parts in groups.values():
        names = tuple(name for _, name in sorted(parts))
        fused.update(dict.fromkeys(names, names))
    return fused


# ---------------------------------------------------------------------------------------------
# A text encoder (an mlx.nn module) in GGUF files, named as llama.cpp names it


def llama_cpp_names(arch: gguf.MODEL_ARCH, blocks: int, names) -> dict[str, str]:
    """transformers tensor names -> llama.cpp's names of them (`blk.N.attn_q.weight` ...), by
    the gguf package's own tables (`gguf.get_tensor_name_map`); a name the table does not know
    is left out."""
    table = gguf.get_tensor_name_map(arch, blocks)
    found = {}
    for name in names:
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is not None:
            found[name] = mapped
    return found


@dataclass(frozen=True)
class ModuleFiles:
    """A module's weights in GGUF files (a model file and, for a vision tower, its `mmproj`):
    `names`, module parameter name -> (file index, file tensor name); `shapes`, the shape the
    module's config gives each parameter; `title`, the component in prose."""

    paths: tuple[Path, ...]
    names: dict[str, tuple[int, str]]
    shapes: dict[str, tuple[int, ...]]
    title: str

    def open(self) -> list[GGUFFile]:
        """The files, each tensor the module reads checked present and of its shape (a
        GGUFError naming the file and the tensor)."""
        files = [GGUFFile(path) for path in self.paths]
        for name, (index, file_name) in self.names.items():
            file = files[index]
            entry = file.entries.get(file_name)
            if entry is None:
                arch = f" (its architecture: {file.architecture})" if file.architecture else ""
                raise GGUFError(
                    f"{file.path} is not a {self.title}{arch}: it has no tensor {file_name}"
                )
            if entry.shape != tuple(self.shapes[name]):
                raise GGUFError(
                    f"{file.path}: tensor {file_name} has shape {list(entry.shape)} where the"
                    f" {self.title}'s config gives {name} the shape {list(self.shapes[name])}"
                )
        return files

    def weights(self, dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
        """The module's parameters: a 2-D weight quantized in the file packed beside its
        `.scales` and `.biases` (quantize.quantize_stored_module makes its layer a quantized
        one), every other tensor a float array cast to `dtype`; one file tensor at a time."""
        files = self.open()
        out: dict[str, mx.array] = {}
        for name, (index, file_name) in self.names.items():
            value = files[index].read(file_name, dtype)
            if isinstance(value, Quantized) and name.endswith(".weight"):
                base = name[: -len(".weight")]
                out[name], out[base + SCALES], out[base + BIASES] = value.packed()
            elif isinstance(value, Quantized):
                out[name] = files[index].read(file_name, dtype, as_float=True)
            else:
                out[name] = value
        return out

    def status(self) -> dict:
        """The component's precision as status reports it: the files and their types."""
        counts: dict[str, int] = {}
        for file in (GGUFFile(path) for path in self.paths):
            for kind, count in file.type_counts().items():
                counts[kind] = counts.get(kind, 0) + count
        return {"format": "gguf", "file": self.paths[0].name, "types": dict(sorted(counts.items()))}

    def stored_bytes(self) -> int:
        """Bytes of tensor data in the files."""
        return sum(
            entry.tensor.n_bytes for path in self.paths for entry in GGUFFile(path).entries.values()
        )

    def read_bytes(self) -> int:
        """Bytes of tensor data of the tensors the module reads (what a load holds, about: the
        files' other tensors, such as an `output.weight` or layers past the module's, left out)."""
        files = [GGUFFile(path) for path in self.paths]
        return sum(
            files[index].entries[file_name].tensor.n_bytes
            for index, file_name in self.names.values()
        )
