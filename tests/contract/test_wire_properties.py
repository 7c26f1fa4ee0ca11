"""Property tests of the container: writer -> reader identity, and a reader that only ever
refuses with WireError whatever bytes it is fed."""

import json

import numpy as np
from gmlx_contract.errors import WireError
from gmlx_contract.wire import DTYPES, read_container, write_container
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

NUMPY_OF = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8, "BOOL": bool}

json_scalars = st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars | st.floats(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
fields_strategy = st.none() | st.dictionaries(st.text(max_size=6), json_values, max_size=4)

# Examples per structured property: the deep search of the same reader is the fuzz corpus's
# (fuzz/fuzz_container.py, the heavy tier); raw bytes get more below.
EXAMPLES = 250


@st.composite
def tensor_sets(draw):
    names = draw(st.lists(st.text(min_size=0, max_size=6), max_size=4, unique=True))
    names = [n for n in names if n != "__metadata__"]
    tensors, dtypes = {}, {}
    for name in names:
        wire_name = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
        tensors[name] = draw(hnp.arrays(NUMPY_OF[wire_name], shape))
        dtypes[name] = wire_name
    return tensors, dtypes


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_sets(), fields_strategy)
def test_writer_then_reader_is_identity(tensor_set, fields):
    tensors, dtypes = tensor_set
    body = write_container(tensors, fields, dtypes)
    assert len(body) % 8 == (sum(a.nbytes for a in tensors.values()) % 8)
    parsed = read_container(body)
    assert list(parsed.tensors) == list(tensors)
    assert parsed.dtypes == dtypes
    assert parsed.fields == (fields or {})
    for name, array in tensors.items():
        got = parsed.tensors[name]
        assert got.dtype == array.dtype and got.shape == array.shape
        assert got.tobytes() == array.tobytes()  # bitwise, so NaN payloads count too
    # Reading and writing again gives the same bytes: the writer is deterministic.
    assert write_container(parsed.tensors, parsed.fields, parsed.dtypes) == body


def read_or_refuse(body):
    """Read `body`; a refusal must be a 400 WireError, anything else fails the test."""
    try:
        read_container(body)
    except WireError as error:
        assert error.status == 400 and error.body["error"]


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_wire_error(body):
    read_or_refuse(body)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_sets(), fields_strategy, st.data())
def test_mutated_containers_only_raise_wire_error(tensor_set, fields, data):
    tensors, dtypes = tensor_set
    body = bytearray(write_container(tensors, fields, dtypes))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        where = data.draw(st.integers(0, max(len(body) - 1, 0)))
        if kind == "flip" and body:
            body[where] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del body[where:]
        elif kind == "insert":
            body[where:where] = data.draw(st.binary(min_size=1, max_size=4))
        elif body:
            del body[where]
    read_or_refuse(bytes(body))


header_values = st.recursive(
    json_scalars | st.floats(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=16,
)
entry_like = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*DTYPES, "F64", "f32"]) | header_values,
        "shape": st.lists(st.integers(-2, 6) | st.booleans(), max_size=3) | header_values,
        "data_offsets": st.lists(st.integers(-4, 40), min_size=0, max_size=3) | header_values,
    }
)
metadata_like = st.dictionaries(
    st.sampled_from(["gmlx", "other"]),
    st.text(max_size=10) | json_values.map(json.dumps) | header_values,
    max_size=2,
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c", "__metadata__"]), entry_like | metadata_like, max_size=4
    ),
    st.binary(max_size=48),
)
def test_structured_headers_only_raise_wire_error(header, data):
    text = json.dumps(header).encode()
    read_or_refuse(len(text).to_bytes(8, "little") + text + data)
