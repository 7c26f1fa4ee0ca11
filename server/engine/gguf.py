"""GGUF model files (llama.cpp's format, as ComfyUI-GGUF and others ship DiTs in it) as MLX
weights, read with the `gguf` package (llama.cpp's own reader), one tensor at a time from the
memory-mapped file: the whole model is never held in float. A DiT's single safetensors file
(ComfyUI's `diffusion_models`, in its checkpoint's own naming) is read the same way
(`SafetensorsFile`), so dit_file.DiTFile maps either onto the family's names; a text encoder's
GGUF files are module_files.ModuleFiles.

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

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import safetensors
from gguf import GGMLQuantizationType as T

from .file_headers import ORIG_SHAPE, HeaderError, common_prefix, gguf_data_end
from .ggml_blocks import BlockLayout, Blocks
from .gguf_affine import GROUP_SIZE, Quantized, affine
from .load_settings import GGUF_WEIGHTS, GGUF_WEIGHTS_SETTING, gguf_weights

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
        except HeaderError as exc:
            raise GGUFError(str(exc)) from None
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
    """gguf's reader, which first checks that the header's types and shapes fit the data as
    llama.cpp checks them (file_headers.gguf_data_end) and that every tensor's data lies
    inside the file, so a file cut short is refused naming the first tensor it cuts (the
    reader itself fails on a reshape that names nothing)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        placed = [
            (
                bytes(f.parts[1]).decode(),
                f.parts[3].tolist(),
                int(f.parts[4][0]),
                int(f.parts[5][0]),
            )
            for f in fields
        ]
        gguf_data_end(Path(self.data.filename), placed, int(self.alignment))
        for name, dims, kind, offset in placed:
            block_size, type_size = gguf.GGML_QUANT_SIZES[T(kind)]
            end = start_offs + offset + math.prod(dims) * type_size // block_size
            if end > len(self.data):
                raise ValueError(
                    f"it is cut short: tensor {name} ends at byte {end},"
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
