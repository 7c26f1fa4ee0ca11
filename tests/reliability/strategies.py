"""Hypothesis strategies for hostile request bodies: containers that are truncated, oversized,
overlapping, of the wrong dtype or an absurd shape, with metadata that is not JSON or nested
deeper than any parser allows; and JSON documents of any shape."""

from __future__ import annotations

import json

import numpy as np
from gmlx_contract import wire
from hypothesis import strategies as st

DTYPE_NAMES = sorted(wire.DTYPES)
NOT_DTYPES = ["F64", "I32", "bf16", "f32", "", "U8 ", "BOOLEAN", 7, None, ["F32"]]
HUGE = [2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]


def frame(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A container from raw header bytes (length prefix = len(header) unless given)."""
    n = len(header) if length is None else length
    return n.to_bytes(8, "little", signed=False) + header + data


def encode_header(header) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode("utf-8")


def deep(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


# ---------------------------------------------------------------- valid pieces


@st.composite
def arrays(draw, max_dims: int = 4, max_side: int = 5):
    """(wire dtype name, numpy array holding that dtype's bytes)."""
    name = draw(st.sampled_from(DTYPE_NAMES))
    shape = draw(st.lists(st.integers(0, max_side), max_size=max_dims))
    dtype = wire.DTYPES[name].numpy
    count = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if name == "BOOL":
        array = array.view(np.uint8).astype(bool)
    return name, array


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def valid_containers(draw):
    """(body, tensors by name, dtypes by name, fields) of a well-formed container."""
    names = draw(st.lists(st.text(min_size=1, max_size=6), max_size=4, unique=True))
    names = [n for n in names if n != wire.METADATA_KEY]
    tensors, dtypes = {}, {}
    for name in names:
        dtype, array = draw(arrays())
        tensors[name], dtypes[name] = array, dtype
    fields = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
    return wire.write_container(tensors, fields, dtypes), tensors, dtypes, fields


# ---------------------------------------------------------------- hostile containers


@st.composite
def bad_entries(draw):
    """One tensor entry that breaks a rule of docs/contract.md §1.3, and data to go with it."""
    kind = draw(
        st.sampled_from(
            ["dtype", "shape", "huge", "offsets", "span", "keys", "bool_shape", "not_object"]
        )
    )
    data = draw(st.binary(max_size=64))
    entry = {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [0, len(data) // 4 * 4]}
    if kind == "dtype":
        entry["dtype"] = draw(st.sampled_from(NOT_DTYPES))
    elif kind == "shape":
        entry["shape"] = draw(st.sampled_from([-1, "4", [1.5], [-2], [None], {"a": 1}, 3]))
    elif kind == "huge":
        entry["shape"] = draw(st.lists(st.sampled_from(HUGE + [0, 1]), min_size=1, max_size=40))
    elif kind == "offsets":
        entry["data_offsets"] = draw(
            st.sampled_from(
                [[0], [0, 1, 2], [-4, 0], [4, 0], [0, 2**64], ["0", "4"], [0.0, 4.0], None]
            )
        )
    elif kind == "span":
        entry["data_offsets"] = [0, len(data) + draw(st.integers(1, 16))]
    elif kind == "keys":
        entry[draw(st.sampled_from(["extra", "Dtype", "offset"]))] = 1
        if draw(st.booleans()):
            del entry["dtype"]
    elif kind == "bool_shape":
        entry["shape"] = [True, False]
    else:
        entry = draw(st.sampled_from([[], "F32", 1, None]))
    return {"t": entry}, data


@st.composite
def overlapping(draw):
    """Two tensors whose byte spans share at least one byte."""
    size = draw(st.integers(1, 8))
    start = draw(st.integers(0, size * 4 - 1))
    length = draw(st.integers(1, 16))
    header = {
        "a": {"dtype": "F32", "shape": [size], "data_offsets": [0, size * 4]},
        "b": {"dtype": "U8", "shape": [length], "data_offsets": [start, start + length]},
    }
    return frame(encode_header(header), bytes(max(size * 4, start + length)))


@st.composite
def bad_metadata(draw):
    kind = draw(st.sampled_from(["not_strings", "not_json", "not_object", "deep", "not_dict"]))
    if kind == "not_strings":
        metadata = {"gmlx": draw(st.sampled_from([1, None, [], {"rows": []}]))}
    elif kind == "not_json":
        metadata = {"gmlx": draw(st.sampled_from(["{", "rows", "{'a': 1}", "\x00", "[1,]"]))}
    elif kind == "not_object":
        metadata = {"gmlx": draw(st.sampled_from(["[]", "1", '"s"', "null", "true"]))}
    elif kind == "deep":
        metadata = {"gmlx": '{"rows": ' + deep(draw(st.integers(900, 200_000))) + "}"}
    else:
        metadata = draw(st.sampled_from([[], "gmlx", 1]))
    return frame(encode_header({"__metadata__": metadata}))


@st.composite
def mangled(draw):
    """A valid container cut short, with bytes flipped, or with a lying length prefix."""
    body = bytearray(draw(valid_containers())[0])
    kind = draw(st.sampled_from(["truncate", "flip", "length", "append"]))
    if kind == "truncate":
        return bytes(body[: draw(st.integers(0, max(len(body) - 1, 0)))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(body) - 1))
            body[i] = draw(st.integers(0, 255))
        return bytes(body)
    if kind == "length":
        n = draw(st.sampled_from([0, 1, len(body), wire.MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1]))
        return n.to_bytes(8, "little") + bytes(body[8:])
    return bytes(body) + draw(st.binary(max_size=32))


def hostile_containers():
    """Every kind of bad container body."""
    return st.one_of(
        st.binary(max_size=64),
        mangled(),
        overlapping(),
        bad_metadata(),
        bad_entries().map(lambda e: frame(encode_header(e[0]), e[1])),
        st.sampled_from(
            [
                frame(deep(100_000).encode()),
                frame(deep(100_000, '{"a":', "}").encode()),
                frame(b"\xff\xfe{}"),
                frame(b"[]"),
                frame(b'"x"'),
                frame(b"{}", length=16),
            ]
        ),
    )
