"""GGUF model files (llama.cpp's format, as ComfyUI-GGUF and others ship DiTs in it) as MLX
weights, read with the `gguf` package (llama.cpp's own reader), one tensor at a time from the
memory-mapped file: the whole model is never held in float. A DiT's single safetensors file
(ComfyUI's `diffusion_models`, in its checkpoint's own naming) is read the same way
(`SafetensorsFile`), so `DiTFile` maps either onto the family's names.

A tensor's GGUF shape lists the input dimension first; here shapes are row-major (out, in), and
a `comfy.gguf.orig_shape.<name>` entry (ComfyUI-GGUF's convert script flattens some tensors to
rows of 256) restores the original. Names may sit under `model.diffusion_model.` or
`diffusion_model.`, which `GGUFFile` strips.

What a linear weight stored quantized becomes, as `GMLX_GGUF_WEIGHTS` says (`held_as`):
- `blocks` (the default): the file's own bytes, every type exact, no bigger than the file
  (ggml_blocks.py: decoded by MLX operations at each matmul, bit for bit gguf's weights). A
  fused weight whose parts mix types, or mix a float part in, keeps each part's bytes.
- `affine`: MLX's affine quantization at group 32 (gguf_affine.py: exact for seven types, at 1.5
  bits a weight more than the file; Q6_K, Q3_K and Q2_K quantized again), for MLX's own
  quantized kernels.
Every other tensor (and a quantized one not stored in its logical rows) is a float array, a
quantized one dequantized by `gguf.quants.dequantize`. A type outside READABLE is refused,
naming the tensor.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import safetensors
from gguf import GGMLQuantizationType as T

from .file_headers import ORIG_SHAPE, common_prefix
from .ggml_blocks import BlockLayout, Blocks
from .gguf_affine import GROUP_SIZE, Quantized, affine, rows_of, swapped_rows, width
from .load_settings import GGUF_WEIGHTS, GGUF_WEIGHTS_SETTING, gguf_weights
from .quantize import BIASES, SCALES

ARCHITECTURE = "general.architecture"
FLOAT_TYPES = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}
QUANTIZED_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
READABLE = (*FLOAT_TYPES, *QUANTIZED_TYPES)

# How a quantized linear weight is held: the file's blocks, or MLX's affine form.
HELD_SETTING = GGUF_WEIGHTS_SETTING
BLOCKS, AFFINE = GGUF_WEIGHTS


def held_as() -> str:
    """`GMLX_GGUF_WEIGHTS`: `blocks` (the default) or `affine`; anything else is refused."""
    return gguf_weights(os.environ.get(HELD_SETTING))


class GGUFError(ValueError):
    """A GGUF file (or a DiT's single safetensors file) that cannot be read as the model's
    weights; the text names the file (and the tensor)."""


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
            if kind not in READABLE:
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

    def read_blocks(self, name: str, swapped: bool = False) -> Blocks:
        """A 2-D tensor stored in its logical rows as the file holds it, quantized or float
        (`swapped`: its two halves of rows exchanged)."""
        entry = self.entries[name]
        count, cols = entry.shape
        data = np.asarray(entry.tensor.data).view(np.uint8).reshape(count, -1)
        if swapped:
            data = np.concatenate([data[count // 2 :], data[: count // 2]])
        value = mx.array(np.ascontiguousarray(data).reshape(-1))
        self._release_pages(entry)
        return Blocks(value, BlockLayout(cols, ((entry.kind, count),)))

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

    def quantized_2d(self, name: str) -> bool:
        """Whether tensor `name` is a quantized one stored in its logical rows (one a linear
        weight may be held quantized as)."""
        entry = self.entries[name]
        return entry.quantized and entry.stored_2d


def readable_types() -> list[str]:
    return [kind.name for kind in READABLE]


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
    (file_headers.PREFIXES), float tensors only (F32, F16, BF16: any other dtype, such as a float8
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
        self, dtype: mx.Dtype | None = None, keep_f32=None, reads=None, quantizing: bool = False
    ) -> dict[str, mx.array | Blocks]:
        """The family's tensors by diffusers name. A linear weight `X.weight` of a fused group
        with a part quantized in the file (every part stored in its logical rows) is held
        quantized, as `held_as()` says: as `Blocks` of the file's bytes (each part's own type,
        float parts too), or in MLX's affine form packed beside `X.scales` and `X.biases`
        (group 32, float32; every part at the widest part's width, widening being exact, and
        only when every part is quantized). A linear weight stored in a float narrower than
        `dtype` (F16 or BF16 at float32 compute) is held as stored too, as blocks, unless the
        load is `quantizing` its float layers. Everything else is a float array cast to
        `dtype` (float32 for the names `keep_f32` picks). Read one file tensor at a time; a file
        tensor none of whose names `reads` picks (the blocks of another rank:
        shard.TreeShard.reads) is never read: its names hold zeros of their shapes that are
        never evaluated (MLX arrays are lazy), for the caller to drop."""
        file, sources = self.open()
        narrower = None if quantizing or dtype is None else dtype.size
        held = self.held(file, sources, narrower)
        out: dict[str, mx.array | Blocks] = {}
        by_file: dict[str, list[tuple[str, int, int]]] = {}
        for name in self.shapes:
            file_name, part, parts = sources[name]
            by_file.setdefault(file_name, []).append((name, part, parts))
        for file_name, targets in by_file.items():
            float_dtype = dtype
            if keep_f32 is not None and all(keep_f32(name) for name, _, _ in targets):
                float_dtype = mx.float32
            swapped = file_name in self.naming.swapped
            form = held.get(targets[0][0]) if all(n in held for n, _, _ in targets) else None
            if reads is not None and not any(reads(name) for name, _, _ in targets):
                for name, _, _ in targets:
                    out.update(self._unread(file, file_name, name, form, float_dtype))
                continue
            if isinstance(form, str):  # blocks
                value = file.read_blocks(file_name, swapped)
                for name, part, parts in targets:
                    out[name] = _split_blocks(value, part, parts)
            elif form is not None:  # affine, at that width
                value = file.read(file_name)
                value = swapped_rows(value) if swapped else value
                for name, part, parts in targets:
                    base = name[: -len(".weight")]
                    packed = rows_of(value, part, parts).packed(held[name])
                    out[name], out[base + SCALES], out[base + BIASES] = packed
            else:
                value = file.read(file_name, float_dtype, as_float=True)
                value = _swapped_halves(value) if swapped else value
                for name, part, parts in targets:
                    out[name] = _split_rows(value, part, parts)
            del value
        return out

    def _unread(self, file, file_name: str, name: str, form, dtype: mx.Dtype | None) -> dict:
        """Lazy zeros in place of a tensor that is not read: as it would be held (blocks, the
        affine form at its width with its scales and biases, or a float array)."""
        shape = tuple(self.shapes[name])
        if form is None:
            return {name: mx.zeros(shape, dtype or mx.float32)}
        rows, cols = shape
        if isinstance(form, str):
            layout = BlockLayout(cols, ((file.entries[file_name].kind, rows),))
            return {name: Blocks(mx.zeros((layout.nbytes,), mx.uint8), layout)}
        base = name[: -len(".weight")]
        return {
            name: mx.zeros((rows, cols * form // 32), mx.uint32),
            base + SCALES: mx.zeros((rows, cols // GROUP_SIZE), mx.float32),
            base + BIASES: mx.zeros((rows, cols // GROUP_SIZE), mx.float32),
        }

    def held(self, file, sources, narrower: int | None = None) -> dict[str, str | int]:
        """Diffusers weight name -> how it is held as stored: BLOCKS, or (affine) the width it
        is packed at; the weights not named are float arrays. Held as stored: the linear
        weights of a fused group with a part quantized in its logical rows, every part stored
        in its logical rows (as affine: every part quantized), and (blocks, `narrower` given)
        those of a float group stored in floats of fewer bytes than `narrower`."""
        affine_form = held_as() == AFFINE
        forms: dict[str, str | int] = {}
        for name, group in self.fused.items():
            entries = [file.entries[sources[part][0]] for part in group]
            if not all(entry.stored_2d for entry in entries):
                continue
            if affine_form:
                if all(entry.quantized for entry in entries):
                    forms[name] = max(width(entry.kind) for entry in entries)
            elif any(entry.quantized for entry in entries) or (
                narrower is not None and all(_narrower(entry, narrower) for entry in entries)
            ):
                forms[name] = BLOCKS
        return forms

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
        """The component's precision as status reports it: a GGUF file, its tensors' types, how
        its quantized linear weights are held (`weights`: BLOCKS or AFFINE) and at how many
        bits a weight (`bits_per_weight`, over those weights); None for a safetensors file
        (float, as a folder's)."""
        file, sources = self.open()
        status = file.status()
        if status is None:
            return None
        held = self.held(file, sources)
        bits = [self._held_bits(file, sources, name, held[name]) for name in held]
        return {**status, "weights": held_as(), "bits_per_weight": bits_per_weight(bits)}

    def stored_bytes(self) -> int:
        """Bytes of tensor data in the file."""
        return sum(entry.nbytes for entry in weights_file(self.path).entries.values())

    def estimated_bytes(self, itemsize: int) -> int:
        """The bytes the family's tensors take loaded (for the status of a model not loaded):
        a weight held as stored (`held`, loaded without a quantize setting) at its file's bytes
        (blocks) or at its MLX width plus float32 scale and bias per group (affine), the rest (a quantized tensor that is no
        linear weight too) at `itemsize` bytes per element."""
        file, sources = self.open()
        held = self.held(file, sources, itemsize)
        total = 0
        for name, shape in self.shapes.items():
            if name in held:
                total += self._held_bits(file, sources, name, held[name])[1] // 8
            else:
                total += int(np.prod(shape, dtype=np.int64)) * itemsize
        return total

    def _held_bits(self, file, sources, name: str, form) -> tuple[int, int]:
        """(elements, bits held) of a weight held quantized."""
        rows, cols = self.shapes[name]
        kind = file.entries[sources[name][0]].kind
        return rows * cols, held_bits(kind, rows * cols, None if isinstance(form, str) else form)


def held_bits(kind: T, elements: int, affine_width: int | None) -> int:
    """The bits `elements` weights of a GGUF `kind` are held in: the file's blocks, or the
    affine form at `affine_width` with a float32 scale and bias per GROUP_SIZE."""
    if affine_width is not None:
        return elements * (affine_width + 2 * 32 // GROUP_SIZE)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    return elements // block_size * type_size * 8


def bits_per_weight(held: list[tuple[int, int]]) -> float | None:
    """Status `bits_per_weight` of (elements, bits) pairs (None: no weight held quantized)."""
    elements = sum(count for count, _ in held)
    return round(sum(bits for _, bits in held) / elements, 3) if elements else None


def _narrower(entry, itemsize: int) -> bool:
    """A float tensor stored in fewer bytes an element than `itemsize`."""
    return entry.kind in (T.F16, T.BF16) and itemsize > 2


def _part_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    if parts == 1:
        return tuple(shape)
    return (shape[0] // parts, *shape[1:]) if shape[0] % parts == 0 else tuple(shape)


def _swapped_halves(value: mx.array) -> mx.array:
    first, second = mx.split(value, 2, axis=0)
    return mx.concatenate([second, first], axis=0)


def _split_blocks(value: Blocks, part: int, parts: int) -> Blocks:
    """Part `part` of `parts` equal row groups of a tensor's blocks (one type: a byte range)."""
    if parts == 1:
        return value
    ((kind, count),) = value.layout.runs
    size = value.data.size // parts
    layout = BlockLayout(value.layout.cols, ((kind, count // parts),))
    return Blocks(value.data[part * size : (part + 1) * size], layout)


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

    def weights(self, dtype: mx.Dtype | None = None) -> dict[str, mx.array | Blocks]:
        """The module's parameters: a 2-D weight quantized in the file held quantized as
        `held_as()` says (`Blocks` of its bytes, or packed beside its `.scales` and `.biases`:
        weights.load_module makes its layer a quantized one), every other tensor a float array
        cast to `dtype`; one file tensor at a time."""
        files = self.open()
        blocks = held_as() == BLOCKS
        out: dict[str, mx.array | Blocks] = {}
        for name, (index, file_name) in self.names.items():
            file = files[index]
            quantized = file.quantized_2d(file_name) and name.endswith(".weight")
            if quantized and blocks:
                out[name] = file.read_blocks(file_name)
            elif quantized:
                value = file.read(file_name)
                base = name[: -len(".weight")]
                out[name], out[base + SCALES], out[base + BIASES] = value.packed()
            else:
                out[name] = file.read(file_name, dtype, as_float=True)
        return out

    def status(self) -> dict:
        """The component's precision as status reports it: the files, their types, how the
        quantized weights are held and at how many bits a weight (as DiTFile.status)."""
        files = [GGUFFile(path) for path in self.paths]
        counts: dict[str, int] = {}
        for file in files:
            for kind, count in file.type_counts().items():
                counts[kind] = counts.get(kind, 0) + count
        affine_form = held_as() == AFFINE
        held = []
        for name, (index, file_name) in self.names.items():
            entry = files[index].entries[file_name]
            if name.endswith(".weight") and files[index].quantized_2d(file_name):
                size = int(np.prod(entry.shape, dtype=np.int64))
                affine_width = width(entry.kind) if affine_form else None
                held.append((size, held_bits(entry.kind, size, affine_width)))
        return {
            "format": "gguf",
            "file": self.paths[0].name,
            "types": dict(sorted(counts.items())),
            "weights": held_as(),
            "bits_per_weight": bits_per_weight(held),
        }

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
