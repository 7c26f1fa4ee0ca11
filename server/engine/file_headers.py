"""The tensors of one weight file, from its header alone: names, row-major shapes, stored types
and a GGUF file's metadata. No MLX and no tensor data: listing a folder of model files reads
these (engine/components.py), so it stays fast and runs in a Python without MLX.

A safetensors header is its JSON. A GGUF header is read here rather than with `gguf`'s
GGUFReader, which turns every metadata array into numpy arrays as it opens the file: a text
encoder's 151,936 tokens and merges cost seconds that a listing of many files cannot spend.
The value types and layout are GGUF's (`gguf.GGUFValueType`); a shape is ggml's reversed,
or a ComfyUI-GGUF `comfy.gguf.orig_shape.<name>` entry where one restores it.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
ORIG_SHAPE = "comfy.gguf.orig_shape."
# Prefixes under which single files hold a DiT's names (ComfyUI's checkpoints and GGUF files).
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# Metadata arrays kept by the reader (the tokenizer's are read only when asked: `tokenizer`).
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


# The stored dtypes of the safetensors tensors the server reads: floats, cast to the compute
# dtype, and the packed words (U32) of a folder `gmlx model quantize` wrote. Float8 (ComfyUI's
# fp8 files) and integers are refused: MLX reads float8 as raw bytes, and a cast would turn
# either into other numbers; float64 MLX does not load at all.
READ_DTYPES = ("F32", "F16", "BF16", "U32")
# PyTorch's BatchNorm step counter (an int64, the FLUX.2 VAE's `bn.num_batches_tracked`), which
# no forward reads: left in the file, never loaded.
UNREAD_COUNTER = ".num_batches_tracked"


class HeaderError(ValueError):
    """A file whose header cannot be read (cut short, or not a weight file); says which."""


def check_read_dtypes(path: Path, types: dict[str, str]) -> None:
    """Refuse the first of a safetensors file's tensors (`types`: name -> dtype) stored in a
    dtype the server does not read (READ_DTYPES): a HeaderError naming the file and the
    tensor."""
    for name, dtype in types.items():
        if dtype not in READ_DTYPES and not name.endswith(UNREAD_COUNTER):
            other = (
                "; for a float8 file, take the model's BF16 or F16 file, or a GGUF"
                if dtype.startswith("F8")
                else ""
            )
            raise HeaderError(
                f"{path}: tensor {name} is stored as {dtype}; the server reads F32, F16 and"
                f" BF16 weights{other}"
            )


@dataclass
class Header:
    """One file's tensors by name (`prefix` stripped where every name has it): row-major shape
    and stored type (safetensors' dtype name, or the GGUF type's name); its metadata (GGUF's
    scalars and short arrays; safetensors' `__metadata__`); its size in bytes."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    types: dict[str, str]
    metadata: dict = field(default_factory=dict)
    prefix: str = ""
    size: int = 0

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def has(self, *names: str) -> bool:
        return all(name in self.shapes for name in names)

    def count(self, *stems: str) -> int:
        """How many numbered blocks `stem.N.` the file holds (0, 1, ... consecutively), under
        whichever of `stems` (one naming's and another's) holds the most."""
        return max(self._depth(stem) for stem in stems)

    def _depth(self, stem: str) -> int:
        found = {
            name[len(stem) :].split(".", 1)[0] for name in self.shapes if name.startswith(stem)
        }
        depth = 0
        while str(depth) in found:
            depth += 1
        return depth

    def first_shape(self, names) -> tuple[int, ...] | None:
        """The shape of the first of `names` (one tensor's names in several namings) the file
        holds; None when it holds none of them."""
        return next((self.shapes[n] for n in names if n in self.shapes), None)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape; a HeaderError naming the file and the tensor when it has none."""
        try:
            return self.shapes[name]
        except KeyError:
            raise HeaderError(f"{self.path} has no tensor {name}") from None


def common_prefix(names: list[str]) -> str:
    """The one of PREFIXES every name starts with, else ""."""
    return next((p for p in PREFIXES if names and all(n.startswith(p) for n in names)), "")


def read(path: Path) -> Header:
    """The header of a `.safetensors` or `.gguf` file, names under one of PREFIXES (when all
    are) stripped; a HeaderError when it cannot be read."""
    path = Path(path)
    try:
        header = _read_gguf(path) if path.suffix.lower() == ".gguf" else _read_safetensors(path)
    except HeaderError:
        raise
    except (OSError, struct.error, ValueError, OverflowError) as exc:  # JSON's and GGUF's enums
        raise HeaderError(f"{path}: not a readable weight file ({exc})") from None
    prefix = common_prefix(list(header.shapes))
    if prefix:
        header.shapes = {n[len(prefix) :]: s for n, s in header.shapes.items()}
        header.types = {n[len(prefix) :]: t for n, t in header.types.items()}
        header.prefix = prefix
    return header


def safetensors_entries(path: Path) -> tuple[dict, dict]:
    """A safetensors file's tensor entries by name ({"dtype", "shape", "data_offsets"}) and its
    `__metadata__`, each entry checked and the file checked to hold their data whole; a
    HeaderError naming the file otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size < 8:
            raise HeaderError(f"{path} is not a safetensors file (only {size} bytes)")
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise HeaderError(f"{path}: its header runs past the end of the file (cut short?)")
            doc = json.loads(handle.read(length))
    except HeaderError:
        raise
    except (OSError, ValueError) as exc:  # JSON's errors are ValueErrors
        raise HeaderError(f"{path}: not a readable weight file ({exc})") from None
    if not isinstance(doc, dict):
        raise HeaderError(f"{path}: its header is not a JSON object of tensors")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise HeaderError(f"{path}: its header's __metadata__ is not a JSON object")
    for name, entry in doc.items():
        _check_entry(path, name, entry)
    end = max((entry["data_offsets"][1] for entry in doc.values()), default=0)
    if 8 + length + end > size:
        raise HeaderError(
            f"{path} is cut short: its tensors end at byte {8 + length + end}, the file has {size}"
        )
    return doc, metadata


def _read_safetensors(path: Path) -> Header:
    doc, metadata = safetensors_entries(path)
    shapes = {name: tuple(entry["shape"]) for name, entry in doc.items()}
    types = {name: entry["dtype"] for name, entry in doc.items()}
    return Header(path, shapes, types, metadata, size=path.stat().st_size)


def _check_entry(path: Path, name: str, entry: object) -> None:
    """Refuse a safetensors header entry that is not {"dtype": str, "shape": [int >= 0, ...],
    "data_offsets": [begin, end]} with 0 <= begin <= end (HeaderError naming the tensor)."""

    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    fine = (
        isinstance(entry, dict)
        and isinstance(entry.get("dtype"), str)
        and isinstance(entry.get("shape"), list)
        and all(whole(side) for side in entry["shape"])
        and isinstance(entry.get("data_offsets"), list)
        and len(entry["data_offsets"]) == 2
        and all(whole(offset) for offset in entry["data_offsets"])
        and entry["data_offsets"][0] <= entry["data_offsets"][1]
    )
    if not fine:
        raise HeaderError(
            f"{path}: its header's entry for {name!r} is not a tensor's dtype, shape and"
            f" data_offsets: {json.dumps(entry)[:200]}"
        )


class _Cursor:
    def __init__(self, data, path: Path):
        self.data, self.at, self.path = data, 0, path

    def take(self, fmt: str):
        width = struct.calcsize(fmt)
        if self.at + width > len(self.data):
            raise HeaderError(f"{self.path}: the GGUF header is cut short")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += width
        return value

    def string(self, keep: bool = True) -> str | None:
        length = self.take("<Q")
        if self.at + length > len(self.data):
            raise HeaderError(f"{self.path}: the GGUF header is cut short")
        text = bytes(self.data[self.at : self.at + length]).decode("utf-8") if keep else None
        self.at += length
        return text

    def value(self, kind: int, keep: bool):
        if kind == GGUFValueType.STRING:
            return self.string(keep)
        if kind == GGUFValueType.ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item != GGUFValueType.STRING and item in _SCALARS:
                width = struct.calcsize(_SCALARS[item])
                if not keep:
                    self.at += width * count
                    return None
                return [self.take(_SCALARS[item]) for _ in range(count)]
            values = [self.value(item, keep) for _ in range(count)]
            return values if keep else None
        return self.take(_SCALARS[GGUFValueType(kind)])


def _read_gguf(path: Path, arrays: tuple[str, ...] = ()) -> Header:
    """A GGUF file's tensors and metadata: scalars, strings, and arrays of up to 16 entries
    (orig_shape), plus the arrays `arrays` names whole."""
    size = path.stat().st_size
    if size < 24:
        raise HeaderError(f"{path} is not a GGUF file (only {size} bytes)")
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        # mapped, so only the header's pages are read from disk
        return _parse_gguf(_Cursor(data, path), path, size, arrays)


def _parse_gguf(cursor: _Cursor, path: Path, size: int, arrays: tuple[str, ...]) -> Header:
    if bytes(cursor.data[:4]) != GGUF_MAGIC:
        raise HeaderError(f"{path} is not a GGUF file (no GGUF magic)")
    cursor.at = 4
    version, tensors, entries = cursor.take("<I"), cursor.take("<Q"), cursor.take("<Q")
    metadata: dict = {}
    for _ in range(entries):
        key = cursor.string()
        kind = cursor.take("<I")
        keep = key in arrays or kind != GGUFValueType.ARRAY or _short_array(cursor)
        value = cursor.value(kind, keep)
        if keep:
            metadata[key] = value
    shapes, types, placed = {}, {}, []
    for _ in range(tensors):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        kind, offset = _tensor_type(cursor.take("<I"), name, path), cursor.take("<Q")
        restored = metadata.get(ORIG_SHAPE + name)
        shapes[name] = tuple(int(v) for v in restored) if restored else tuple(reversed(dims))
        types[name] = kind.name
        placed.append((name, dims, kind, offset))
    alignment = gguf_alignment(path, metadata.get("general.alignment", 32))
    end = gguf_data_end(path, placed, alignment)
    start = -(-cursor.at // alignment) * alignment
    if start + end > size:
        raise HeaderError(
            f"{path} is cut short: its tensors end at byte {start + end}, the file has {size}"
        )
    metadata["gguf.version"] = version
    return Header(path, shapes, types, metadata, size=size)


def gguf_alignment(path: Path, value: object) -> int:
    """The file's `general.alignment`, a power of two as GGUF requires."""
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise HeaderError(f"{path}: its general.alignment {value!r} is not a power of two")
    return value


def gguf_data_end(path: Path, placed: list[tuple[str, list[int], int, int]], alignment: int) -> int:
    """Where the last tensor's data ends in the data section, each of `placed` (name, ggml
    dims, GGML type, offset, in the header's order) checked as llama.cpp checks a file it
    loads: rows of whole blocks of its type, and its data where the data before it ends,
    padded to `alignment`. A header whose type or shape of a tensor does not fit the data
    (a relabelled type, an edited shape) is refused, naming the tensors."""
    end, before = 0, "the data section's start"
    for name, dims, kind, offset in placed:
        kind = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if dims and dims[0] % block:
            raise HeaderError(
                f"{path}: tensor {name} is {kind.name} in rows of {dims[0]} values, not whole"
                f" blocks of {block}"
            )
        expected = -(-end // alignment) * alignment
        if offset != expected:
            raise HeaderError(
                f"{path}: tensor {name}'s data is at byte {offset} of the data section, not"
                f" at {expected} where {before} ends: the header's types or shapes do not"
                " fit its data"
            )
        end = offset + math.prod(dims) // block * block_bytes
        before = f"tensor {name} ({kind.name}, {' x '.join(map(str, dims))})"
    return end


def _tensor_type(kind: int, name: str, path: Path) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(kind)
    except ValueError:
        raise HeaderError(
            f"{path}: tensor {name} is stored in GGML type {kind}, which the installed gguf"
            " package does not know (a newer llama.cpp quantization?)"
        ) from None


def _short_array(cursor: _Cursor) -> bool:
    """Whether the array at the cursor holds at most 16 entries (peeked, not consumed)."""
    item, count = struct.unpack_from("<IQ", cursor.data, cursor.at)
    return count <= 16 and item != GGUFValueType.ARRAY


def gguf_tokenizer(path: Path) -> dict | None:
    """A llama.cpp GGUF file's tokenizer metadata (`tokenizer.ggml.model`, `.pre`, `.tokens`,
    `.merges`, `.token_type`), or None when it carries no tokens."""
    metadata = _read_gguf(Path(path), TOKENIZER_KEYS).metadata
    if "tokenizer.ggml.tokens" not in metadata:
        return None
    return {key: value for key, value in metadata.items() if key.startswith("tokenizer.ggml.")}
