"""Z-Image through the whole seam over HTTP on a tiny folder, found by the product registry
(its spec.py): the family's facts in its status and manifest (read from the files against
the loaded model's: tests/families/test_conformance.py), encode, steps (equal to the
diffusers transformer under the pipeline's time and sign) and refusals (the VAE routes, and a
LoRA table against the checkpoint with it merged, on this family's LORA_LAYERS:
tests/families/test_conformance.py)."""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.registry import ModelRegistry
from PIL import Image

from tests.compare import rel_l2
from tests.families.z_image.reference import reference_dit
from tests.families.z_image.tiny.folder import build_tiny_folder
from tests.server.conftest import out_of, serve


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("z_image")
    transformer = build_tiny_folder(root / "z-image-tiny", variant="turbo")
    build_tiny_folder(root / "z-image-base-tiny", seed=1, variant="base")
    config = replace(ServerConfig(host="127.0.0.1", port=0), model_dirs=[root])
    config = replace(config, image=ImageConfig())
    server = serve(config, ModelRegistry([root], "z-image-tiny", max_resident=2))
    server.transformer = transformer
    yield server
    server.close()


def encode(live, text: str) -> np.ndarray:
    r = live.post_json("encode", {"model": "z-image-tiny", "text": text})
    assert r.status_code == 200, r.text
    return wire.read_container(r.content).tensors["cond"]


def step(live, x, sigmas, conds, convention="comfy"):
    rows = [{"cond": live.put_tensor(cond)} for cond in conds]
    fields = {"model": "z-image-tiny", "rows": rows, "convention": convention}
    timestep = np.asarray(sigmas, np.float32)
    return live.post_container("step", {"x": x, "timestep": timestep}, fields)


def test_status_and_manifest_say_the_familys_facts(live):
    unloaded = live.call("GET", "models/z-image-tiny/status").json()
    assert unloaded["family"] == "z_image" and unloaded["variant"] == "turbo"
    assert unloaded["resident"] is False
    assert unloaded["comfy"] == {"model_class": "ZImage", "image_model": "lumina2"}
    assert unloaded["latent"] == {"channels": 16, "stride": 8, "patch": 2}
    assert unloaded["vae"]["channels_out"] == 3 and unloaded["vae"]["stride"] == 8
    assert unloaded["edit_capable"] is False
    assert unloaded["sampling"] == {
        "steps": 8,
        "cfg": 1.0,
        "shift": 3.0,
        "sigmas": None,
        "schedule": None,
        "neg_skip": [],
        "timestep_scale": 1.0,
    }
    manifest = live.call("GET", "models/z-image-tiny/manifest").json()
    names = {t["name"]: t["shape"] for t in manifest["tensors"]}
    assert names["layers.0.attention.to_q.weight"] == [64, 64]  # unfused diffusers names
    assert names["all_x_embedder.2-1.weight"] == [64, 64]


def test_base_variant_is_identified_by_its_shift(live):
    status = live.call("GET", "models/z-image-base-tiny/status").json()
    assert status["variant"] == "base"
    assert (status["sampling"]["steps"], status["sampling"]["cfg"]) == (50, 5.0)
    assert status["sampling"]["shift"] == 6.0


@pytest.mark.parametrize("convention", ["comfy", "reference"])
def test_step_is_the_pipelines_velocity(live, convention):
    """Both conventions: timestep = sigma, out = -transformer(x, 1 - sigma), as ZImagePipeline
    computes noise_pred; two rows of different caption lengths in one step."""
    conds = [encode(live, "a red fox"), encode(live, "")]
    assert conds[0].shape[1] != conds[1].shape[1]
    x = np.random.default_rng(1).standard_normal((2, 16, 6, 10)).astype(np.float32)
    sigmas = np.array([0.8, 0.35], np.float32)
    r = step(live, x, sigmas, conds, convention)
    assert r.headers["X-Gmlx-Prefix-Cache"] == "none"
    expected = -reference_dit(live.transformer, x, 1 - sigmas, [c[0] for c in conds])
    assert rel_l2(out_of(r), expected) <= 1e-4


def test_bad_steps_are_refused(live):
    cond = encode(live, "a red fox")
    odd = step(live, np.zeros((1, 16, 5, 6), np.float32), [0.5], [cond])
    assert odd.status_code == 400
    assert (
        "latents 5x6 (48x40 pixels): z-image-tiny takes images whose sides are multiples"
        " of 16" in (odd.json()["error"])
    )
    for sides in ((1, 1), (1, 2), (2, 1)):  # no token at all: the quick plan estimates none
        tiny = step(live, np.zeros((1, 16, *sides), np.float32), [0.5], [cond])
        assert tiny.status_code == 400 and "multiples of 16" in tiny.json()["error"], tiny.text
    r = step(live, np.zeros((1, 16, 4, 4), np.float32), [0.5], [cond[:, :, :8]])
    assert r.status_code == 400 and "conditioning" in r.text
    ref = live.put_tensor(np.ones((1, 16, 4, 4), np.float32))
    fields = {
        "model": "z-image-tiny",
        "rows": [{"cond": live.put_tensor(cond), "ref_latents": [ref]}],
    }
    x = {"x": np.zeros((1, 16, 4, 4), np.float32), "timestep": np.array([0.5], np.float32)}
    assert live.post_container("step", x, fields).status_code == 400


def test_encode_refuses_images(live):
    png = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(png, format="PNG")
    image = base64.b64encode(png.getvalue()).decode()
    r = live.post_json("encode", {"model": "z-image-tiny", "text": "a", "images": [image]})
    assert r.status_code == 400 and "no reference images" in r.text
