"""The tensor container of the step contract: a safetensors file (docs/contract.md §1.3-1.5).

The reader validates every rule of §1.3 and hands out numpy views over the body (no tensor
byte is copied); the writer is deterministic, so equal inputs give equal bytes on both sides.
BF16 travels as its raw 16-bit patterns: numpy sees it as little-endian uint16.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ContractError, WireError

CONTAINER_TYPE = "application/vnd.gmlx.tensors+safetensors"
JSON_TYPE = "application/json"

MiB = 1 << 20
GiB = 1 << 30

# Size limits (docs/contract.md §1.5).
MAX_HEADER_BYTES = 16 * MiB
MAX_CONTAINER_BYTES = GiB + MiB
MAX_JSON_BYTES = 64 * MiB
# How deeply a JSON document may nest: far beyond any document of the contract, and far enough
# below Python's recursion limit that hashing or re-encoding a document never overflows it.
MAX_JSON_DEPTH = 64
MAX_UPLOAD_BYTES = GiB  # one tensor or adapter, before the caches' own bounds
MAX_ADAPTER_FILE = 4 * GiB
MAX_ROWS = 16
MAX_VAE_IMAGES = 16
MAX_PIXELS = 2048 * 2048
MAX_SIDE = 4096
MAX_RUNS = 32


def over_pixel_limits(width: int, height: int) -> bool:
    """Whether an image of width x height pixels is over the limits of steps and VAE passes."""
    return width * height > MAX_PIXELS or max(width, height) > MAX_SIDE


METADATA_KEY = "__metadata__"
FIELDS_KEY = "gmlx"
ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
LENGTH_BYTES = 8
HEADER_ALIGN = 8
# Shapes numpy can hold: its sizes are signed 64-bit, and 32 dimensions work on numpy 1 and 2.
MAX_ARRAY_BYTES = (1 << 63) - 1
MAX_NDIM = 32


@dataclass(frozen=True)
class WireDtype:
    """One row of the dtype table (docs/contract.md §1.4)."""

    name: str  # wire name: header `dtype`, also hashed
    short: str  # capabilities and manifest
    numpy: np.dtype  # how numpy holds it (BF16: uint16 bits)

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


DTYPES: dict[str, WireDtype] = {
    d.name: d
    for d in (
        WireDtype("F32", "f32", np.dtype("<f4")),
        WireDtype("F16", "f16", np.dtype("<f2")),
        WireDtype("BF16", "bf16", np.dtype("<u2")),
        WireDtype("U8", "u8", np.dtype("u1")),
        WireDtype("BOOL", "bool", np.dtype("?")),
    )
}
# The wire dtype a numpy array is written as when the caller does not say (uint16 = BF16 bits).
_DEFAULT_WIRE = {d.numpy: d.name for d in DTYPES.values()}
# The dtypes capabilities lists (docs/contract.md §1.4 quirk: no bool although BOOL is read).
CAPABILITY_DTYPES = ["f32", "f16", "bf16", "u8"]


def is_container_type(content_type: str | None) -> bool:
    """Whether a Content-Type names the container (the part before any `;`)."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip() == CONTAINER_TYPE


def check_body_size(n: int | None, limit: int) -> None:
    """Refuse (413) a body of `n` bytes over `limit`; the route calls this before reading."""
    if n is not None and n > limit:
        raise ContractError(413, f"request body of {n} bytes is over the limit of {limit} bytes")


# ---------------------------------------------------------------- reader


@dataclass
class Container:
    """A parsed container: numpy views over the body, their wire dtypes and the fields."""

    tensors: dict[str, np.ndarray]
    dtypes: dict[str, str]
    fields: dict[str, Any]
    spans: dict[str, tuple[int, int]] = field(repr=False)
    data: memoryview = field(repr=False)
    # The whole __metadata__ object (strings), where `fields` is its `gmlx` entry parsed; other
    # writers keep their own entries there (diffusers' LoRA config, safetensors' "format").
    metadata: dict[str, str] = field(default_factory=dict, repr=False)

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes exactly as they sit in the body (what its hash covers)."""
        start, end = self.spans[name]
        return self.data[start:end]


def read_container(body: bytes | bytearray | memoryview) -> Container:
    """Parse and validate a container; every refusal is a `WireError` (400)."""
    view = memoryview(body)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    header_len = _header_length(view)
    header = _parse_header(view[LENGTH_BYTES : LENGTH_BYTES + header_len])
    data = view[LENGTH_BYTES + header_len :]

    metadata = header.pop(METADATA_KEY, None)
    fields = _fields_from_metadata(metadata)
    entries = {name: _check_entry(name, entry, len(data)) for name, entry in header.items()}
    spans = {name: (start, end) for name, (_, _, start, end) in entries.items()}
    _check_no_overlap(spans)

    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, (wire, shape, start, end) in entries.items():
        count = (end - start) // wire.itemsize
        array = np.frombuffer(data, dtype=wire.numpy, count=count, offset=start)
        tensors[name] = array.reshape(shape)
        dtypes[name] = wire.name
    return Container(
        tensors=tensors,
        dtypes=dtypes,
        fields=fields,
        spans=spans,
        data=data,
        metadata=dict(metadata or {}),
    )


def _header_length(view: memoryview) -> int:
    if len(view) < LENGTH_BYTES:
        raise WireError(f"container of {len(view)} bytes is shorter than its 8-byte length prefix")
    header_len = int.from_bytes(view[:LENGTH_BYTES], "little")
    if header_len > MAX_HEADER_BYTES:
        raise WireError(
            f"container header length {header_len} is over the limit of {MAX_HEADER_BYTES} bytes"
        )
    if LENGTH_BYTES + header_len > len(view):
        raise WireError(
            f"container header length {header_len} runs past the end of the {len(view)}-byte body"
        )
    return header_len


def load_json(text: str | bytes) -> Any:
    """`json.loads`, refusing (ValueError) a document nested deeper than MAX_JSON_DEPTH."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError("the document nests too deeply") from None
    if _nesting(doc) > MAX_JSON_DEPTH:
        raise ValueError(f"the document nests deeper than {MAX_JSON_DEPTH} levels")
    return doc


def _nesting(doc: Any) -> int:
    """How many arrays and objects deep a parsed document goes (without recursion)."""
    deepest, pending = 0, [(doc, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, dict) else value
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in children)
    return deepest


def _parse_header(raw: memoryview) -> dict[str, Any]:
    try:
        header = load_json(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise WireError(f"container header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise WireError(f"container header is a JSON {type(header).__name__}, not an object")
    return header


def _fields_from_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError(f"container {METADATA_KEY} must be an object of strings")
    text = metadata.get(FIELDS_KEY)
    if text is None:
        return {}
    try:
        fields = load_json(text)
    except ValueError as error:
        raise WireError(f"container {METADATA_KEY}.{FIELDS_KEY} is not JSON: {error}") from None
    if not isinstance(fields, dict):
        raise WireError(
            f"container {METADATA_KEY}.{FIELDS_KEY} is a JSON {type(fields).__name__}, "
            "not an object"
        )
    return fields


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(
    name: str, entry: Any, data_len: int
) -> tuple[WireDtype, tuple[int, ...], int, int]:
    """Validate one tensor entry; return (dtype, shape, start, end)."""
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        raise WireError(
            f"tensor {name!r}: entry must be an object with exactly the keys "
            "dtype, shape, data_offsets"
        )
    dtype_name = entry["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise WireError(f"tensor {name!r}: dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    wire = DTYPES[dtype_name]
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise WireError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if len(shape) > MAX_NDIM:
        raise WireError(f"tensor {name!r}: shape has {len(shape)} dimensions, over {MAX_NDIM}")
    if math.prod(d for d in shape if d) * wire.itemsize > MAX_ARRAY_BYTES:
        raise WireError(f"tensor {name!r}: shape {shape} is too large for an array")
    offsets = entry["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets)):
        raise WireError(f"tensor {name!r}: data_offsets {offsets!r} is not a pair of integers")
    start, end = offsets
    if not 0 <= start <= end <= data_len:
        raise WireError(
            f"tensor {name!r}: data_offsets [{start}, {end}] lie outside the "
            f"{data_len}-byte data section"
        )
    expected = math.prod(shape) * wire.itemsize
    if end - start != expected:
        raise WireError(
            f"tensor {name!r}: span of {end - start} bytes does not hold shape {shape} of "
            f"{dtype_name} ({expected} bytes)"
        )
    return wire, tuple(shape), start, end


def _check_no_overlap(spans: dict[str, tuple[int, int]]) -> None:
    """Refuse two tensors whose byte spans share a byte (empty spans share none)."""
    ordered = sorted((start, end, name) for name, (start, end) in spans.items() if end > start)
    for (_, prev_end, prev_name), (start, _, name) in zip(ordered, ordered[1:], strict=False):
        if start < prev_end:
            raise WireError(f"tensors {prev_name!r} and {name!r} have overlapping byte spans")


# ---------------------------------------------------------------- writer


def wire_array(array: Any, dtype: str | None = None) -> tuple[str, np.ndarray]:
    """The wire dtype name and the C-contiguous little-endian array whose bytes go on the wire.

    Without `dtype` the array's own dtype decides (uint16 is BF16 bits; an `ml_dtypes`
    bfloat16 array is taken by its bits). With `dtype` the array must already hold that
    wire dtype's numpy form. Copies only when the array is not contiguous or not little-endian.
    """
    array = np.asarray(array)
    if dtype is None and array.flags.c_contiguous:
        own = _DEFAULT_WIRE.get(array.dtype)  # the common case, without the checks below
        if own is not None:
            return own, array
    if array.dtype.name == "bfloat16" and array.dtype.itemsize == 2:
        array = array.view(np.uint16)
    own = _DEFAULT_WIRE.get(array.dtype.newbyteorder("<"))
    if dtype is None:
        if own is None:
            raise ValueError(
                f"numpy dtype {array.dtype} has no wire dtype; convert to one of "
                "float32, float16, uint16 (bf16 bits), uint8, bool"
            )
        dtype = own
    wire = DTYPES.get(dtype)
    if wire is None:
        raise ValueError(f"wire dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if array.dtype.newbyteorder("<") != wire.numpy.newbyteorder("<"):
        raise ValueError(f"a {array.dtype} array cannot be written as {dtype}")
    if array.dtype != wire.numpy or not array.flags.c_contiguous:
        # np.array rather than np.ascontiguousarray, which would turn a scalar into shape (1,).
        array = np.array(array, dtype=wire.numpy, order="C")
    return wire.name, array


def encode_fields(fields: dict[str, Any]) -> str:
    """The `__metadata__.gmlx` string: sorted keys, no whitespace."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def write_container(
    tensors: dict[str, Any],
    fields: dict[str, Any] | None = None,
    dtypes: dict[str, str] | None = None,
) -> bytes:
    """Write a container deterministically (docs/contract.md §1.3), as one bytes object."""
    return b"".join(container_pieces(tensors, fields, dtypes))


def container_pieces(
    tensors: dict[str, Any],
    fields: dict[str, Any] | None = None,
    dtypes: dict[str, str] | None = None,
) -> list[bytes | memoryview]:
    """The bytes of `write_container` as pieces, without joining them: the length prefix and
    header first, then each tensor's bytes as a view of its array (no copy when the array
    is already contiguous in its wire dtype). A server sends the pieces one after the other
    instead of copying megabytes into one buffer first.

    Tensors are packed back to back in the given order; `__metadata__` comes last and is
    omitted when `fields` is empty; the header is padded with spaces to a multiple of 8.
    """
    dtypes = dtypes or {}
    header: dict[str, Any] = {}
    chunks: list[memoryview] = []
    offset = 0
    for name, array in tensors.items():
        if name == METADATA_KEY:
            raise ValueError(f"a tensor cannot be named {METADATA_KEY}")
        wire_name, data = wire_array(array, dtypes.get(name))
        size = data.nbytes
        header[name] = {
            "dtype": wire_name,
            "shape": list(data.shape),
            "data_offsets": [offset, offset + size],
        }
        if size:
            chunks.append(data.reshape(-1).view(np.uint8).data)
        offset += size
    if fields:
        header[METADATA_KEY] = {FIELDS_KEY: encode_fields(fields)}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGN)
    return [len(text).to_bytes(LENGTH_BYTES, "little") + text, *chunks]


# ---------------------------------------------------------------- bfloat16 helpers


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) to float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values to bfloat16 bit patterns, rounding to nearest even (NaN stays NaN)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return out
