"""models, status, manifest, load/unload, encode (JSON and container) and the VAE routes
(docs/contract.md §2.2-2.6, 2.12-2.13)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.hashing import tensor_hash
from PIL import Image

from .linear_family import image_latent, text_cond, vae_decode_array, vae_encode_array

RNG = np.random.default_rng(3)


def test_models_listing(fresh):
    doc = fresh.call("GET", "models").json()
    assert doc["default_model"] == "alpha"
    assert doc["models"] == [
        {"model": "alpha", "family": "test_linear", "variant": "base", "resident": False},
        {"model": "beta", "family": "test_linear", "variant": "turbo", "resident": False},
        {"model": "broken", "family": "test_linear", "variant": "base", "resident": False},
        {"model": "stranger", "family": None},
    ]
    assert fresh.post_json("models/load", {"model": "alpha"}).json() == {
        "model": "alpha",
        "resident": True,
    }
    resident = {m["model"]: m.get("resident") for m in fresh.call("GET", "models").json()["models"]}
    assert resident["alpha"] is True and resident["beta"] is False


def test_status_and_manifest(fresh):
    status = fresh.call("GET", "models/alpha/status").json()
    assert status["model"] == "alpha" and status["family"] == "test_linear"
    assert status["variant"] == "base" and status["resident"] is True
    assert status["latent"] == {"channels": 4, "stride": 8, "patch": 1}
    manifest = fresh.call("GET", "models/beta/manifest").json()
    assert manifest["model"] == "beta" and manifest["naming"] == "diffusers"
    assert manifest["count"] == len(manifest["tensors"]) == 1


@pytest.mark.parametrize("model", ["ghost", "stranger", "broken-not-there"])
def test_status_manifest_load_unload_answer_404_for_any_resolution_failure(fresh, model):
    assert fresh.call("GET", f"models/{model}/status").status_code == 404
    assert fresh.call("GET", f"models/{model}/manifest").status_code == 404
    assert fresh.post_json("models/load", {"model": model}).status_code == 404
    assert fresh.post_json("models/unload", {"model": model}).status_code == 404


def test_a_resident_model_whose_folder_has_gone_can_still_be_unloaded(fresh):
    import shutil

    assert fresh.post_json("models/load", {"model": "beta"}).status_code == 200
    folder = fresh.ctx.registry.folders()["beta"]
    shutil.move(folder, folder.parent.parent / "beta-moved")
    fresh.ctx.registry.folders()  # listed again: beta resolves no more
    assert fresh.call("GET", "models/beta/status").status_code == 404
    r = fresh.post_json("models/unload", {"model": "beta"})
    assert r.status_code == 200 and r.json() == {"model": "beta", "unloaded": True}
    assert "beta" not in fresh.ctx.registry.resident_ids()
    assert fresh.post_json("models/unload", {"model": "beta"}).status_code == 404


def test_load_of_a_mismatched_entry_is_400_and_empty_model_is_the_default(fresh):
    assert fresh.post_json("models/load", {"model": "broken"}).status_code == 400
    assert fresh.post_json("models/load", {"model": ""}).json()["model"] == "alpha"
    assert fresh.post_json("models/load").json()["model"] == "alpha"


# ---------------------------------------------------------------- encode


def png_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_encode_json_text_only_stores_the_cond(live):
    r = live.post_json("encode", {"text": "a cat"})
    assert r.status_code == 200 and r.headers["Content-Type"] == wire.CONTAINER_TYPE
    c = wire.read_container(r.content)
    want = text_cond("a cat")
    np.testing.assert_array_equal(c.tensors["cond"], want)
    assert c.fields == {
        "cond": tensor_hash(want),
        "ref_latents": [],
        "image_slots": [],
        "num_tokens": 5,
    }
    assert live.call("HEAD", f"tensors/{tensor_hash(want)}").status_code == 200


def test_encode_json_images_with_and_without_refs(live):
    rgb = RNG.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    rgba = RNG.integers(0, 256, (8, 8, 4), dtype=np.uint8)
    doc = {"text": "edit", "images": [png_b64(rgb), png_b64(rgba)]}
    c = wire.read_container(live.post_json("encode", doc).content)
    assert sorted(c.tensors) == ["cond", "ref_0", "ref_1"]
    np.testing.assert_array_equal(c.tensors["ref_0"], image_latent(rgb))
    np.testing.assert_array_equal(c.tensors["ref_1"], image_latent(rgba))
    assert c.fields["ref_latents"] == [
        tensor_hash(image_latent(rgb)),
        tensor_hash(image_latent(rgba)),
    ]
    assert c.fields["image_slots"] == [0, 1]
    for digest in c.fields["ref_latents"]:
        assert live.call("HEAD", f"tensors/{digest}").status_code == 200
    c = wire.read_container(live.post_json("encode", {**doc, "refs": False}).content)
    assert sorted(c.tensors) == ["cond"] and c.fields["ref_latents"] == []
    assert c.fields["image_slots"] == [0, 1]


def test_encode_container_orders_images_by_length_then_name(live):
    images = {f"image_{i}": np.full((8, 8, 3), i * 20, np.uint8) for i in (10, 2, 1)}
    body = wire.write_container(images, {"text": "x", "refs": True})
    r = live.call("POST", "encode", data=body, headers={"Content-Type": wire.CONTAINER_TYPE})
    c = wire.read_container(r.content)
    for slot, i in enumerate((1, 2, 10)):
        np.testing.assert_array_equal(c.tensors[f"ref_{slot}"], image_latent(images[f"image_{i}"]))


@pytest.mark.parametrize(
    "doc",
    [
        {},
        {"text": 5},
        {"text": "x", "images": "abc"},
        {"text": "x", "images": [1]},
        {"text": "x", "images": ["not base64!"]},
        {"text": "x", "images": ["data:image/png;base64,iVBORw0KGgo="]},
        {"text": "x", "images": [base64.b64encode(b"not an image").decode()]},
        {"text": "x", "images": [png_b64(np.zeros((8, 8, 3), np.uint8))] * 11},
        {"text": "x", "refs": "yes"},
        {"text": "x", "prompt_upsampling": True},
        {"text": "x", "prompt_upsampling": "no"},
    ],
)
def test_encode_refusals(live, doc):
    r = live.post_json("encode", doc)
    assert r.status_code == 400, r.text


def test_encode_accepts_upsampling_false_or_null(live):
    for value in (False, None):
        assert (
            live.post_json("encode", {"text": "x", "prompt_upsampling": value}).status_code == 200
        )


def test_encode_container_refuses_non_u8_images(live):
    body = wire.write_container({"image_0": np.zeros((8, 8, 3), np.float32)}, {"text": "x"})
    r = live.call("POST", "encode", data=body, headers={"Content-Type": wire.CONTAINER_TYPE})
    assert r.status_code == 400


def test_encoded_tensor_over_the_cache_bound_is_413(server_factory):
    server = server_factory(tensor_cache_mb=1)
    assert server.post_json("encode", {"text": "y" * 40000}).status_code == 413


# ---------------------------------------------------------------- VAE


def test_vae_decode_one_image_at_a_time(live):
    latents = RNG.random((2, 4, 2, 3), dtype=np.float32)
    r = live.post_container("vae/decode", {"latents": latents})
    image = wire.read_container(r.content).tensors["image"]
    assert image.shape == (2, 16, 24, 3)
    for i in range(2):
        np.testing.assert_array_equal(image[i], vae_decode_array(latents[i], False))
    r = live.post_container("vae/decode", {"latents": latents}, {"alpha": True})
    assert wire.read_container(r.content).tensors["image"].shape == (2, 16, 24, 4)


def test_vae_encode(live):
    image = RNG.random((2, 16, 16, 4), dtype=np.float32)
    r = live.post_container("vae/encode", {"image": image})
    latents = wire.read_container(r.content).tensors["latents"]
    assert latents.shape == (2, 4, 2, 2)
    np.testing.assert_array_equal(latents[1], vae_encode_array(image[1]))


@pytest.mark.parametrize(
    "route, tensors, fields, status",
    [
        ("vae/decode", {"latents": np.zeros((17, 4, 1, 1), np.float32)}, {}, 413),
        ("vae/decode", {"latents": np.zeros((4, 1, 1), np.float32)}, {}, 400),
        ("vae/decode", {"latents": np.zeros((1, 4, 0, 1), np.float32)}, {}, 400),
        ("vae/encode", {"image": np.zeros((1, 0, 16, 3), np.float32)}, {}, 400),
        ("vae/decode", {"latents": np.zeros((), np.float32)}, {}, 400),
        ("vae/decode", {"z": np.zeros((1, 4, 1, 1), np.float32)}, {}, 400),
        ("vae/decode", {"latents": np.zeros((1, 4, 300, 300), np.float32)}, {}, 413),
        ("vae/decode", {"latents": np.zeros((1, 4, 1, 1), np.float32)}, {"alpha": 1}, 400),
        ("vae/decode", {"latents": np.zeros((1, 3, 1, 1), np.float32)}, {}, 400),
        ("vae/decode", {"latents": np.zeros((1, 4, 1, 1), np.float32)}, {"model": "ghost"}, 404),
        ("vae/encode", {"image": np.zeros((17, 8, 8, 3), np.uint8)}, {}, 413),
        ("vae/encode", {"image": np.zeros((8, 8, 3), np.uint8)}, {}, 400),
        ("vae/encode", {"image": np.zeros((1, 2100, 2100, 1), np.uint8)}, {}, 413),
        ("vae/encode", {"image": np.zeros((1, 8, 4100, 1), np.uint8)}, {}, 413),
    ],
)
def test_vae_refusals(live, route, tensors, fields, status):
    r = live.post_container(route, tensors, fields)
    assert r.status_code == status, r.text
