"""Container reader and writer (docs/contract.md §1.3-1.5)."""

import json

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.errors import ContractError, WireError
from gmlx_contract.wire import (
    CONTAINER_TYPE,
    check_body_size,
    is_container_type,
    read_container,
    write_container,
)

from tests.contract.frames import frame

WORKED_HEADER = b'{"t":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}}'


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_worked_example_byte_for_byte():
    body = write_container({"t": np.array([[1.0, 2.0]], dtype=np.float32)})
    expected = bytes.fromhex("3800000000000000") + WORKED_HEADER + bytes.fromhex("0000803f00000040")
    assert len(WORKED_HEADER) == 56
    assert body == expected
    parsed = read_container(body)
    assert parsed.dtypes == {"t": "F32"}
    assert parsed.fields == {}
    np.testing.assert_array_equal(parsed.tensors["t"], [[1.0, 2.0]])


def test_header_layout_order_padding_and_fields():
    fields = {"z": 1, "a": {"y": [1, 2], "b": None}}
    body = write_container(
        {"second": np.zeros(3, np.uint8), "first": np.ones((1,), np.float16)}, fields
    )
    n = int.from_bytes(body[:8], "little")
    header = body[8 : 8 + n]
    assert n % 8 == 0
    text = header.rstrip(b" ")
    assert header[len(text) :] == b" " * (n - len(text))
    assert b" " not in text  # no whitespace inside the header JSON
    doc = json.loads(text)
    assert list(doc) == ["second", "first", "__metadata__"]
    assert doc["second"]["data_offsets"] == [0, 3]
    assert doc["first"]["data_offsets"] == [3, 5]
    assert doc["__metadata__"] == {"gmlx": '{"a":{"b":null,"y":[1,2]},"z":1}'}
    assert len(body) == 8 + n + 5
    assert read_container(body).fields == fields


@pytest.mark.parametrize("fields", [None, {}])
def test_metadata_omitted_without_fields(fields):
    body = write_container({"t": np.zeros(1, np.float32)}, fields)
    assert b"__metadata__" not in body


def test_every_dtype_round_trips_with_its_wire_name():
    arrays = {
        "f32": np.array([1.5, -2.0], np.float32),
        "f16": np.array([[0.5]], np.float16),
        "bf16": np.array([0x3F80, 0x4000], np.uint16),
        "u8": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "bool": np.array([True, False, True]),
    }
    parsed = read_container(write_container(arrays))
    assert parsed.dtypes == {"f32": "F32", "f16": "F16", "bf16": "BF16", "u8": "U8", "bool": "BOOL"}
    for name, array in arrays.items():
        assert parsed.tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(parsed.tensors[name], array)


def test_scalar_and_zero_size_shapes():
    arrays = {"s": np.array(3.0, np.float32), "empty": np.zeros((2, 0, 3), np.float16)}
    body = write_container(arrays)
    parsed = read_container(body)
    assert parsed.tensors["s"].shape == ()
    assert parsed.tensors["s"] == 3.0
    assert parsed.tensors["empty"].shape == (2, 0, 3)
    header = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])
    assert header["s"]["shape"] == []
    assert header["empty"]["data_offsets"] == [4, 4]


def test_reader_is_zero_copy():
    body = bytearray(
        write_container({"a": np.arange(4, dtype=np.float32), "b": np.ones(2, np.uint8)})
    )
    parsed = read_container(body)
    a = parsed.tensors["a"]
    before = a[1]
    data_start = len(body) - 18
    body[data_start + 4 : data_start + 8] = np.float32(42.0).tobytes()
    assert before == 1.0 and a[1] == 42.0  # the view sees the body's bytes, no copy was made
    assert bytes(parsed.raw("b")) == b"\x01\x01"
    assert len(parsed.raw("a")) == 16


def test_reader_accepts_memoryview_and_readonly_views():
    body = write_container({"t": np.arange(3, dtype=np.float32)})
    parsed = read_container(memoryview(body))
    assert not parsed.tensors["t"].flags.writeable
    np.testing.assert_array_equal(parsed.tensors["t"], [0, 1, 2])


def test_bf16_is_carried_as_bits_and_dtypes_override():
    bits = np.array([0x3F80, 0xC000, 0x7FC0], np.uint16)
    parsed = read_container(write_container({"x": bits}, dtypes={"x": "BF16"}))
    assert parsed.dtypes["x"] == "BF16" and parsed.tensors["x"].dtype == np.uint16
    np.testing.assert_array_equal(parsed.tensors["x"], bits)
    values = wire.bf16_bits_to_f32(parsed.tensors["x"])
    np.testing.assert_array_equal(values[:2], [1.0, -2.0])
    assert np.isnan(values[2])


def test_writer_refuses_unknown_or_mismatched_dtypes():
    with pytest.raises(ValueError, match="float64"):
        write_container({"x": np.zeros(2)})
    with pytest.raises(ValueError, match="cannot be written as F16"):
        write_container({"x": np.zeros(2, np.float32)}, dtypes={"x": "F16"})
    with pytest.raises(ValueError, match="cannot be named"):
        write_container({"__metadata__": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="not one of"):
        write_container({"x": np.zeros(2, np.float32)}, dtypes={"x": "F64"})


def test_writer_normalises_byte_order_and_layout():
    big = np.array([1.0, 2.0], dtype=">f4")
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    parsed = read_container(write_container({"big": big, "strided": strided}))
    np.testing.assert_array_equal(parsed.tensors["big"], [1.0, 2.0])
    np.testing.assert_array_equal(parsed.tensors["strided"], strided)
    assert parsed.raw("big").tobytes() == np.array([1.0, 2.0], "<f4").tobytes()


def test_writer_is_deterministic():
    tensors = {"x": np.arange(5, dtype=np.float32), "m": np.array([True])}
    assert write_container(tensors, {"b": 1, "a": 2}) == write_container(tensors, {"a": 2, "b": 1})


def test_not_checked_padding_gaps_trailing_bytes_names():
    header = {"": entry(offsets=(4, 12)), "weird name ✓": entry("U8", (1,), (20, 21))}
    body = frame(header, bytes(24))  # unpadded header, gap at 0..4 and 12..20, trailing bytes
    parsed = read_container(body)
    assert set(parsed.tensors) == {"", "weird name ✓"}
    assert parsed.fields == {}


def test_metadata_without_gmlx_gives_empty_fields():
    body = frame({"t": entry(), "__metadata__": {"other": "x"}}, bytes(8))
    assert read_container(body).fields == {}


def test_empty_spans_never_overlap():
    header = {"a": entry("F32", (0,), (4, 4)), "b": entry("F32", (2,), (0, 8))}
    assert set(read_container(frame(header, bytes(8))).tensors) == {"a", "b"}


REFUSALS = [
    ("short body", b"\x01\x00\x00", "shorter than"),
    ("header over 16 MiB", (16 * 2**20 + 1).to_bytes(8, "little") + b"{}", "over the limit"),
    ("header past end", (100).to_bytes(8, "little") + b"{}", "past the end"),
    ("header not JSON", frame(b"{nope"), "not JSON"),
    ("header not UTF-8", frame(b'{"\xff":1}'), "not JSON"),
    ("header not object", frame([1, 2]), "not an object"),
    ("metadata not object", frame({"__metadata__": ["a"]}), "object of strings"),
    ("metadata value not string", frame({"__metadata__": {"gmlx": {}}}), "object of strings"),
    ("entry missing key", frame({"t": {"dtype": "F32", "shape": [1]}}), "exactly the keys"),
    ("entry extra key", frame({"t": {**entry(), "x": 1}}, bytes(8)), "exactly the keys"),
    ("entry not object", frame({"t": [1]}), "exactly the keys"),
    ("unknown dtype", frame({"t": entry("F64")}, bytes(8)), "dtype 'F64'"),
    ("dtype not string", frame({"t": entry(["F32"])}, bytes(8)), "dtype ['F32']"),
    ("lower-case dtype", frame({"t": entry("f32")}, bytes(8)), "dtype 'f32'"),
    ("shape negative", frame({"t": entry(shape=(-2,))}, bytes(8)), "non-negative integers"),
    ("shape bool", frame({"t": entry(shape=(True, 2))}, bytes(8)), "non-negative integers"),
    ("shape float", frame({"t": entry(shape=(2.0,))}, bytes(8)), "non-negative integers"),
    ("shape not list", frame({"t": entry(shape="2")}, bytes(8)), "non-negative integers"),
    ("shape too large", frame({"t": entry(shape=(0, 2**62, 4))}, bytes(8)), "too large"),
    ("too many dims", frame({"t": entry(shape=(1,) * 40, offsets=(0, 4))}, bytes(8)), "dimensions"),
    ("offsets triple", frame({"t": entry(offsets=(0, 4, 8))}, bytes(8)), "pair of integers"),
    ("offsets bool", frame({"t": entry(offsets=(False, 8))}, bytes(8)), "pair of integers"),
    ("offsets float", frame({"t": entry(offsets=(0, 8.0))}, bytes(8)), "pair of integers"),
    ("offsets past end", frame({"t": entry(offsets=(4, 12))}, bytes(8)), "outside"),
    ("offsets negative", frame({"t": entry(offsets=(-8, 0))}, bytes(8)), "outside"),
    ("offsets reversed", frame({"t": entry(shape=(0,), offsets=(8, 0))}, bytes(8)), "outside"),
    ("span length", frame({"t": entry(shape=(3,))}, bytes(8)), "does not hold"),
    (
        "overlap",
        frame({"a": entry(offsets=(0, 8)), "b": entry("U8", (2,), (6, 8))}, bytes(8)),
        "overlapping",
    ),
    ("gmlx not JSON", frame({"__metadata__": {"gmlx": "{x"}}), "not JSON"),
    ("gmlx not object", frame({"__metadata__": {"gmlx": "[1]"}}), "not an object"),
]


@pytest.mark.parametrize(
    "body, needle", [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS]
)
def test_every_refusal_is_a_400_wire_error_naming_the_problem(body, needle):
    with pytest.raises(WireError) as caught:
        read_container(body)
    assert caught.value.status == 400
    assert needle in str(caught.value)
    assert caught.value.body == {"error": str(caught.value)}


def test_deeply_nested_header_is_a_wire_error():
    with pytest.raises(WireError):
        read_container(frame(b"[" * 100000 + b"]" * 100000))


def test_check_body_size():
    check_body_size(100, 100)
    check_body_size(None, 100)
    with pytest.raises(ContractError) as caught:
        check_body_size(101, 100)
    assert caught.value.status == 413
    assert "101" in caught.value.message and "100" in caught.value.message


def test_limits_match_the_contract():
    assert wire.MAX_HEADER_BYTES == 16_777_216
    assert wire.MAX_CONTAINER_BYTES == 1_074_790_400
    assert wire.MAX_JSON_BYTES == 64 * 2**20
    assert wire.MAX_PIXELS == 4_194_304 and wire.MAX_SIDE == 4096
    assert (wire.MAX_ROWS, wire.MAX_VAE_IMAGES, wire.MAX_RUNS) == (16, 16, 32)
    assert wire.MAX_ADAPTER_FILE == 4 * 2**30


def test_content_type_check():
    assert is_container_type(CONTAINER_TYPE)
    assert is_container_type(CONTAINER_TYPE + "; charset=binary")
    assert not is_container_type("application/json")
    assert not is_container_type(None)
    assert not is_container_type(CONTAINER_TYPE + "x")


def test_dtype_table():
    assert {d.name: (d.short, d.itemsize) for d in wire.DTYPES.values()} == {
        "F32": ("f32", 4),
        "F16": ("f16", 2),
        "BF16": ("bf16", 2),
        "U8": ("u8", 1),
        "BOOL": ("bool", 1),
    }


def test_bf16_rounding_matches_nearest_even():
    values = np.array([1.0, 1.00390625, 1.01171875, -3.5, np.inf, 1e-40], np.float32)
    bits = wire.f32_to_bf16_bits(values)
    # 1 + 2^-8 is a tie -> even (1.0); 1 + 3*2^-8 is a tie -> even (1 + 2^-6)
    np.testing.assert_array_equal(
        wire.bf16_bits_to_f32(bits)[:5], np.array([1.0, 1.0, 1.015625, -3.5, np.inf], np.float32)
    )
    assert np.isnan(wire.bf16_bits_to_f32(wire.f32_to_bf16_bits(np.array([np.nan]))))[0]


def test_load_json_bounds_nesting():
    at_limit = "[" * wire.MAX_JSON_DEPTH + "]" * wire.MAX_JSON_DEPTH
    assert wire.load_json(at_limit) == json.loads(at_limit)
    for depth in (wire.MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(ValueError, match="nests"):
            wire.load_json('{"a":' * depth + "0" + "}" * depth)
    fields = json.dumps({"a": [[[]]] * 3})
    assert wire.load_json(fields) == json.loads(fields)
