"""Tensor hash (docs/contract.md §1.7) and patch-table id (§1.8)."""

import hashlib

import numpy as np
from gmlx_contract.hashing import canonical_json, hash_parts, is_digest, table_id, tensor_hash
from gmlx_contract.wire import read_container, write_container

PAIR_HASH = "65a6f951125f8221974319829d9874056f93a105c7895b777c381ff92b879ff9"
SCALAR_HASH = "12b0cb7e19ff333078425599375de5d3ab9893c270de5970ba07f46917807b0a"
TABLE_ID = "219ea576f54619286bf44ed4405f595faeedbc563ca68b1d3a7707614043e168"


def test_worked_example_pair():
    assert tensor_hash(np.array([[1.0, 2.0]], np.float32)) == PAIR_HASH
    hashed = b"F32[1, 2]" + bytes.fromhex("0000803f00000040")
    assert hashlib.sha256(hashed).hexdigest() == PAIR_HASH
    assert hash_parts("F32", [1, 2], bytes.fromhex("0000803f00000040")) == PAIR_HASH


def test_worked_example_scalar():
    assert tensor_hash(np.array(1.0, np.float32)) == SCALAR_HASH
    assert hash_parts("F32", (), np.float32(1.0).tobytes()) == SCALAR_HASH


def test_hash_of_container_bytes_equals_hash_of_array():
    arrays = {"a": np.arange(6, dtype=np.float16).reshape(1, 2, 3), "b": np.array([7], np.uint16)}
    parsed = read_container(write_container(arrays))
    for name, array in arrays.items():
        from_raw = hash_parts(parsed.dtypes[name], parsed.tensors[name].shape, parsed.raw(name))
        assert from_raw == tensor_hash(array)


def test_dtype_shape_and_name_independence():
    values = np.array([1.0, 2.0], np.float32)
    assert tensor_hash(values) != tensor_hash(values.reshape(1, 2))
    assert tensor_hash(values) != tensor_hash(values.astype(np.float16))
    bits = np.array([1, 2], np.uint16)
    assert tensor_hash(bits) == hash_parts("BF16", [2], bits.tobytes())
    assert tensor_hash(bits, "BF16") == tensor_hash(bits)
    big_endian = values.astype(">f4")
    assert tensor_hash(big_endian) == tensor_hash(values)
    strided = np.arange(8, dtype=np.float32)[::2]
    assert tensor_hash(strided) == tensor_hash(np.array([0, 2, 4, 6], np.float32))


def test_worked_table_id():
    doc = {
        "entries": [
            {
                "band": None,
                "key": "diffusion_model.transformer_blocks.0.attn.to_q.weight",
                "patches": [
                    {
                        "alpha": 16.0,
                        "down": "b" * 64,
                        "strength": 1.0,
                        "strength_model": 1.0,
                        "up": "a" * 64,
                    }
                ],
            }
        ],
        "model": "qwen-image",
    }
    assert table_id(doc) == TABLE_ID
    reordered = {"model": "qwen-image", "entries": doc["entries"]}
    assert table_id(reordered) == TABLE_ID


def test_canonical_json_follows_python_formatting():
    assert canonical_json({"b": [1, 1.0, 1e-05, None, True], "a": "é"}) == (
        b'{"a":"\\u00e9","b":[1,1.0,1e-05,null,true]}'
    )
    assert table_id({"x": 1}) != table_id({"x": 1.0})


def test_is_digest():
    assert is_digest(PAIR_HASH)
    assert not is_digest(PAIR_HASH.upper())
    assert not is_digest(PAIR_HASH[:-1])
    assert not is_digest(PAIR_HASH + "0")
    assert not is_digest(None)
