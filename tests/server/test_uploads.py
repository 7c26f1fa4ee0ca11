"""HEAD/PUT tensors and adapters, malformed containers, the LRU caches, adapters/register and
patch tables (docs/contract.md §1.3, 2.7-2.9)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.hashing import canonical_json, table_id, tensor_hash

from tests.contract.frames import frame

from .conftest import CONTAINER

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("kind", ["tensors", "adapters"])
def test_head_put_head(live, kind):
    array = RNG.standard_normal((3, 5), dtype=np.float32)
    digest = tensor_hash(array)
    assert live.call("HEAD", f"{kind}/{digest}").status_code == 404
    r = live.call(
        "PUT", f"{kind}/{digest}", data=wire.write_container({"w": array}), headers=CONTAINER
    )
    assert r.status_code == 200 and r.json() == {"hash": digest}
    r = live.call("HEAD", f"{kind}/{digest}")
    assert r.status_code == 200 and r.content == b""
    other = "tensors" if kind == "adapters" else "adapters"
    assert live.call("HEAD", f"{other}/{digest}").status_code == 404


@pytest.mark.parametrize("digest", ["abc", "A" * 64, "g" * 64, "0" * 65])
def test_bad_digests(live, digest):
    assert live.call("HEAD", f"tensors/{digest}").status_code == 400
    r = live.call(
        "PUT",
        f"adapters/{digest}",
        data=wire.write_container({"w": np.ones(1, np.float32)}),
        headers=CONTAINER,
    )
    assert r.status_code == 400 and "64 lowercase" in r.json()["error"]


def test_hash_mismatch_answers_got(live):
    array = np.arange(4, dtype=np.float32)
    wrong = "0" * 64
    r = live.call(
        "PUT", f"tensors/{wrong}", data=wire.write_container({"t": array}), headers=CONTAINER
    )
    assert r.status_code == 400
    assert r.json()["got"] == tensor_hash(array)
    assert live.call("HEAD", f"tensors/{wrong}").status_code == 404


def test_same_values_other_dtype_hash_differently(live):
    values = np.arange(4, dtype=np.float32)
    f16 = values.astype(np.float16)
    digest = live.put_tensor(f16)
    assert digest != tensor_hash(values)
    bf16 = wire.f32_to_bf16_bits(values)
    assert live.put_tensor(bf16) == tensor_hash(bf16)


def test_put_refusals(live):
    digest = "a" * 64
    r = live.call("PUT", f"tensors/{digest}", json={})
    assert r.status_code == 415
    two = wire.write_container({"a": np.ones(1, np.float32), "b": np.ones(1, np.float32)})
    r = live.call("PUT", f"tensors/{digest}", data=two, headers=CONTAINER)
    assert r.status_code == 400 and "exactly one" in r.json()["error"]
    none = wire.write_container({})
    assert live.call("PUT", f"tensors/{digest}", data=none, headers=CONTAINER).status_code == 400


MALFORMED = {
    "short": b"\x01\x00\x00",
    "header past the end": struct.pack("<Q", 100) + b"{}",
    "header over 16 MiB": struct.pack("<Q", (16 << 20) + 1) + b"{}",
    "header not json": struct.pack("<Q", 4) + b"{{{{",
    "header a list": frame([]),
    "metadata not strings": frame({"__metadata__": {"gmlx": 1}}),
    "fields not json": frame({"__metadata__": {"gmlx": "{"}}),
    "fields a list": frame({"__metadata__": {"gmlx": "[]"}}),
    "extra key": frame(
        {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, b"\0" * 4
    ),
    "bad dtype": frame({"t": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
    "bool shape": frame(
        {"t": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "negative shape": frame(
        {"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "outside data": frame({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
    "wrong span": frame({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8),
    "overlap": frame(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("route", ["tensors/" + "a" * 64, "step", "vae/decode", "encode"])
def test_malformed_containers_are_400(live, name, route):
    method = "PUT" if route.startswith("tensors") else "POST"
    r = live.call(method, route, data=MALFORMED[name], headers=CONTAINER)
    assert r.status_code == 400, (name, route, r.text)
    assert isinstance(r.json()["error"], str)


def test_upload_over_the_cache_bound_is_413_and_limits_follow_the_cache(server_factory):
    server = server_factory(tensor_cache_mb=1, adapter_cache_mb=2)
    limits = server.call("GET", "capabilities", versioned=False).json()["limits"]
    assert limits["max_tensor_bytes"] == 1 << 20 and limits["max_adapter_bytes"] == 2 << 20
    big = np.zeros((1 << 18) + 1, np.float32)  # 1 MiB + 4 bytes
    digest = tensor_hash(big)
    body = wire.write_container({"t": big})
    assert server.call("PUT", f"tensors/{digest}", data=body, headers=CONTAINER).status_code == 413
    assert server.call("PUT", f"adapters/{digest}", data=body, headers=CONTAINER).status_code == 200


def test_lru_head_does_not_refresh_but_a_step_read_does(server_factory):
    server = server_factory(tensor_cache_mb=1)
    # three conditionings of 400 KiB: two fit in 1 MiB
    conds = [np.full((1, 12800, 8), i, np.float32) for i in range(3)]
    a, b = server.put_tensor(conds[0]), server.put_tensor(conds[1])
    assert server.call("HEAD", f"tensors/{a}").status_code == 200  # a HEAD, no refresh
    c = server.put_tensor(conds[2])
    assert [server.call("HEAD", f"tensors/{h}").status_code for h in (a, b, c)] == [404, 200, 200]
    # now read b through a step, then add a again: c is the least recently used
    x = np.zeros((1, 4, 1, 1), np.float32)
    r = server.post_container(
        "step", {"x": x, "timestep": np.zeros(1, np.float32)}, {"rows": [{"cond": b}]}
    )
    assert r.status_code == 200
    server.put_tensor(conds[0])
    assert [server.call("HEAD", f"tensors/{h}").status_code for h in (a, b, c)] == [200, 200, 404]


# ---------------------------------------------------------------- adapters/register


def test_register_adapter_file(live, tmp_path):
    root = live.ctx.registry.model_dirs[0]
    up = RNG.standard_normal((6, 2), dtype=np.float32)
    down = RNG.standard_normal((2, 5), dtype=np.float32).astype(np.float16)
    path = root / "alpha" / "lora.safetensors"
    path.write_bytes(wire.write_container({"up": up, "down": down}))
    r = live.post_json("adapters/register", {"path": str(path)})
    assert r.status_code == 200
    assert r.json() == {"tensors": {"up": tensor_hash(up), "down": tensor_hash(down)}}
    assert live.call("HEAD", f"adapters/{tensor_hash(down)}").status_code == 200


def test_register_refuses_paths_outside_the_model_folders(live, tmp_path):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(wire.write_container({"w": np.ones((2, 2), np.float32)}))
    assert live.post_json("adapters/register", {"path": str(outside)}).status_code == 404
    root = live.ctx.registry.model_dirs[0]
    link = root / "alpha" / "escape.safetensors"
    link.symlink_to(outside)
    assert live.post_json("adapters/register", {"path": str(link)}).status_code == 404
    sneaky = f"{root}/alpha/../../{outside.parent.name}/outside.safetensors"
    assert live.post_json("adapters/register", {"path": sneaky}).status_code == 404
    assert live.post_json("adapters/register", {"path": str(root / "nope")}).status_code == 404
    assert live.post_json("adapters/register", {"path": str(root / "alpha")}).status_code == 404
    assert live.post_json("adapters/register", {"path": 5}).status_code == 400
    assert live.post_json("adapters/register", {}).status_code == 400
    # outside them, a file that is there and one that is not get the same words: the route
    # tells no client which paths exist
    there = live.post_json("adapters/register", {"path": str(outside)}).json()["error"]
    missing = live.post_json("adapters/register", {"path": str(outside) + "-none"}).json()
    assert missing["error"] == there.replace(str(outside), str(outside) + "-none")


def test_register_refuses_a_file_that_is_not_a_container(live):
    path = live.ctx.registry.model_dirs[0] / "alpha" / "junk.safetensors"
    path.write_bytes(b"\xff" * 64)
    assert live.post_json("adapters/register", {"path": str(path)}).status_code == 400


# ---------------------------------------------------------------- patch tables


def lora_pair(out=4, rank=2, inp=4, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((out, rank), dtype=np.float32),
        rng.standard_normal((rank, inp), dtype=np.float32),
    )


def table(up: str, down: str, **patch) -> dict:
    return {
        "entries": [
            {
                "key": "diffusion_model.proj.weight",
                "band": None,
                "patches": [{"up": up, "down": down, "alpha": 4.0, "strength": 0.5, **patch}],
            }
        ],
        "model": "alpha",
    }


def put_table(server, doc, digest=None, **params):
    body = canonical_json(doc)
    digest = digest or table_id(doc)
    return server.call(
        "PUT",
        f"patch-tables/{digest}",
        data=body,
        headers={"Content-Type": "application/json"},
        params=params,
    )


def test_patch_table_order_of_checks(fresh):
    up, down = lora_pair()
    doc = table(tensor_hash(up), tensor_hash(down))
    # 1: the id must match (400 with got)
    r = put_table(fresh, doc, digest="0" * 64)
    assert r.status_code == 400 and r.json()["got"] == table_id(doc)
    # 2: the body must be an object (the id of a list is checked first)
    r = put_table(fresh, [1, 2])
    assert r.status_code == 400 and "object" in r.json()["error"]
    # 3: the model loads: unknown 404, not of a family 400
    assert put_table(fresh, {**doc, "model": "ghost"}).status_code == 404
    assert put_table(fresh, doc, model="stranger").status_code == 400
    # 4: entries must be a list
    assert put_table(fresh, {"entries": {}}).status_code == 400
    # 5: every up/down present, else 409 with a sorted, de-duplicated list; "None" for absent
    doc2 = {
        "entries": [
            {
                "key": "proj.weight",
                "patches": [
                    {"up": tensor_hash(up), "down": tensor_hash(down)},
                    {"up": tensor_hash(up)},
                ],
            },
        ]
    }
    r = put_table(fresh, doc2)
    assert r.status_code == 409
    assert r.json()["missing"] == sorted({tensor_hash(up), tensor_hash(down), "None"})
    # then the table is built and registered
    fresh.put_tensor(up, "adapters")
    fresh.put_tensor(down, "adapters")
    r = put_table(fresh, doc)
    assert r.status_code == 200 and r.json() == {"id": table_id(doc)}


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"strength_model": 2.0}, "strength_model"),
        ({"kind": "loha"}, "kind"),
        ({"mid": "x"}, "unknown members"),
        ({"strength": "big"}, "strength"),
    ],
)
def test_patch_refusals(fresh, patch, message):
    up, down = lora_pair()
    fresh.put_tensor(up, "adapters")
    fresh.put_tensor(down, "adapters")
    r = put_table(fresh, table(tensor_hash(up), tensor_hash(down), **patch))
    assert r.status_code == 400 and message in r.json()["error"]


def test_bias_keys_and_bad_bands_are_refused(fresh):
    up, down = lora_pair()
    u, d = fresh.put_tensor(up, "adapters"), fresh.put_tensor(down, "adapters")
    doc = table(u, d)
    doc["entries"][0]["key"] = "diffusion_model.proj.bias"
    assert put_table(fresh, doc).status_code == 400
    doc = table(u, d)
    doc["entries"][0]["band"] = [0, 1]
    assert put_table(fresh, doc).status_code == 400


def test_a_table_serves_steps_and_is_gone_after_a_reload(fresh):
    up, down = lora_pair()
    u, d = fresh.put_tensor(up, "adapters"), fresh.put_tensor(down, "adapters")
    doc = table(u, d)
    tid = put_table(fresh, doc, model="alpha").json()["id"]
    cond = fresh.put_tensor(np.ones((1, 2, 8), np.float32))
    x = np.ones((1, 4, 1, 1), np.float32)
    tensors = {"x": x, "timestep": np.zeros(1, np.float32)}
    fields = {"rows": [{"cond": cond}], "patch_table": tid}
    r = fresh.post_container("step", tensors, fields)
    assert r.status_code == 200
    out = wire.read_container(r.content).tensors["out"]
    plain = wire.read_container(
        fresh.post_container("step", tensors, {"rows": [{"cond": cond}]}).content
    ).tensors["out"]
    # the test model adds strength * alpha / rank = 0.5 * 4 / 2
    np.testing.assert_allclose(out - plain, 1.0, rtol=0, atol=1e-6)
    assert fresh.post_json("models/unload", {"model": "alpha"}).json()["unloaded"] is True
    r = fresh.post_container("step", tensors, fields)
    assert r.status_code == 409 and r.json()["missing"] == [tid]


@pytest.mark.parametrize("kind", ["tensors", "adapters"])
def test_cached_upload_does_not_pin_trailing_padding(live, kind):
    """A body may carry unused bytes after its tensor; the cache keeps the tensor's own bytes
    only, never a view over the whole body (which the cache would count as 4 bytes)."""
    array = np.array([1.5], dtype=np.float32)
    digest = tensor_hash(array)
    body = wire.write_container({"t": array}) + bytes(4 << 20)
    r = live.call("PUT", f"{kind}/{digest}", data=body, headers=CONTAINER)
    assert r.status_code == 200, r.text
    cache = live.ctx.service.tensors if kind == "tensors" else live.ctx.service.adapters
    kept = cache.get(digest).array
    assert memory_owner_bytes(kept) == array.nbytes
    np.testing.assert_array_equal(kept, array)


def memory_owner_bytes(array: np.ndarray) -> int:
    """The size of the buffer that finally owns an array's memory (down its chain of bases)."""
    owner = array
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    if isinstance(owner, np.ndarray):
        return owner.nbytes
    return memoryview(owner).nbytes
