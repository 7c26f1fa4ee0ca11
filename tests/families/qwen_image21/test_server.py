"""Every model route end to end against the real Qwen-Image 2.1 family, over the embedded default
model (a tiny random-weight folder generated with numpy, seconds on a CPU)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.hashing import tensor_hash
from gmlx_server.config import ServerConfig
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.registry import ModelRegistry
from PIL import Image

from tests.catalog import FAMILIES
from tests.server.conftest import serve

embedded = pytest.importorskip("gmlx_server.engine.families.qwen_image21.embedded")
family = pytest.importorskip("gmlx_server.engine.families.qwen_image21.family")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = embedded.ensure_embedded_model(tmp_path_factory.mktemp("embedded"))
    registry = ModelRegistry([], folder.name, extra_models=[folder])
    server = serve(ServerConfig(host="127.0.0.1", port=0), registry)
    server.model_id = folder.name
    server.folder = folder
    yield server
    server.close()


def png_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_discovery_routes(qwen):
    caps = qwen.call("GET", "capabilities", versioned=False).json()
    assert caps["families"] == FAMILIES
    models = qwen.call("GET", "models").json()
    assert models == {
        "models": [
            {
                "model": qwen.model_id,
                "family": "qwen_image21",
                "variant": "turbo",
                "resident": False,
            },
        ],
        "default_model": qwen.model_id,
    }
    status = qwen.call("GET", f"models/{qwen.model_id}/status").json()
    assert status["resident"] is False  # described from its files, not loaded
    assert status["comfy"] == {"model_class": "QwenImage21", "image_model": "qwen_image21"}
    assert status["latent"] == {"channels": 64, "stride": 16, "patch": 1}
    assert status["sampling"]["sigmas"][-1] == 0.0
    manifest = qwen.call("GET", f"models/{qwen.model_id}/manifest").json()
    assert manifest["naming"] == "diffusers" and manifest["count"] == len(manifest["tensors"]) > 0


def test_encode_step_and_vae_through_the_routes(qwen):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
    r = qwen.post_json("encode", {"text": "a red cube", "images": [png_b64(image)]})
    assert r.status_code == 200, r.text
    c = wire.read_container(r.content)
    fields = c.fields
    assert fields["cond"] == tensor_hash(c.tensors["cond"])
    assert fields["num_tokens"] == c.tensors["cond"].shape[1]
    assert len(fields["ref_latents"]) == 1 and len(fields["image_slots"]) == 1
    ref = c.tensors["ref_0"]
    assert ref.shape == (1, 64, 16, 16)

    run = qwen.post_json("runs/begin", {}).json()["run"]
    x = rng.standard_normal((2, 64, 4, 4), dtype=np.float32)
    t = np.array([0.9, 0.9], np.float32)
    rows = [
        {
            "cond": fields["cond"],
            "ref_latents": fields["ref_latents"],
            "image_slots": fields["image_slots"],
        },
        {"cond": fields["cond"], "num_tokens": 3},
    ]
    answers = [
        qwen.post_container("step", {"x": x, "timestep": t}, {"rows": rows, "run": run})
        for _ in range(2)
    ]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert [a.headers["X-Gmlx-Prefix-Cache"] for a in answers] == ["miss", "hit"]
    outs = [wire.read_container(a.content).tensors["out"] for a in answers]
    assert outs[0].shape == x.shape
    np.testing.assert_array_equal(outs[0], outs[1])  # a prefix hit equals the miss

    # the same arrays through a model of its own, in process: equal to the route's answer
    direct = family.QWEN_IMAGE21.load(qwen.folder, qwen.model_id)
    cond = c.tensors["cond"][0]
    direct_rows = [
        StepRow(
            cond=cond,
            cond_key="a",
            ref_latents=(ref[0],),
            ref_keys=("r",),
            image_slots=tuple(fields["image_slots"]),
        ),
        StepRow(cond=cond[:3], cond_key="b"),
    ]
    want = direct.denoise_step(x, t, direct_rows).out
    np.testing.assert_array_equal(outs[0], want)
    assert qwen.post_json(f"runs/{run}/end").json()["ended"] is True

    r = qwen.post_container("vae/decode", {"latents": ref}, {"alpha": True})
    decoded = wire.read_container(r.content).tensors["image"]
    assert decoded.shape == (1, 256, 256, 4) and 0.0 <= decoded.min() <= decoded.max() <= 1.0
    r = qwen.post_container("vae/encode", {"image": decoded})
    assert wire.read_container(r.content).tensors["latents"].shape == (1, 64, 16, 16)


def test_engine_refusals_are_400(qwen):
    cond = qwen.put_tensor(np.ones((1, 4, 7), np.float32))  # wrong width for this DiT
    x = np.zeros((1, 64, 2, 2), np.float32)
    r = qwen.post_container(
        "step", {"x": x, "timestep": np.zeros(1, np.float32)}, {"rows": [{"cond": cond}]}
    )
    assert r.status_code == 400 and "conditioning" in r.json()["error"]
    tiny = png_b64(np.zeros((64, 64, 3), np.uint8))  # under the reference area
    assert qwen.post_json("encode", {"text": "x", "images": [tiny]}).status_code == 400


def test_hostile_prompts_and_references_are_400_and_the_server_goes_on(qwen):
    """A prompt past the tokens the DiT's RoPE table holds is refused before the text encoder
    runs (its attention grows with the square of the length: a long enough prompt exhausted
    the machine's memory); a lone surrogate is no text; a reference latent of no area is no
    reference. Each names what is wrong, and a normal encode follows."""
    from gmlx_server.engine.families.qwen_image21.prompt import MAX_PROMPT_TOKENS

    r = qwen.post_json("encode", {"text": "a " * (MAX_PROMPT_TOKENS + 8)})
    assert r.status_code == 400 and f"reads at most {MAX_PROMPT_TOKENS}" in r.json()["error"]
    r = qwen.post_json("encode", {"text": "a\udfff b"})
    assert r.status_code == 400 and "lone surrogate at 1" in r.json()["error"], r.text
    encoded = qwen.post_json("encode", {"text": "a red cube"})
    assert encoded.status_code == 200
    cond = wire.read_container(encoded.content).fields["cond"]
    empty = qwen.put_tensor(np.zeros((1, 64, 0, 0), np.float32))
    x = np.zeros((1, 64, 4, 4), np.float32)
    rows = [{"cond": cond, "ref_latents": [empty]}]
    r = qwen.post_container(
        "step", {"x": x, "timestep": np.full(1, 0.5, np.float32)}, {"rows": rows}
    )
    assert r.status_code == 400 and "got (64, 0, 0)" in r.json()["error"], r.text


def test_status_of_a_misconfigured_folder_is_400_naming_the_missing_piece(qwen, tmp_path):
    import json
    import shutil

    root = tmp_path / "models"
    no_mean = shutil.copytree(qwen.folder, root / "no-mean")
    config_path = no_mean / "vae" / "config.json"
    config = json.loads(config_path.read_text())
    del config["latents_mean"]
    config_path.write_text(json.dumps(config))
    no_config = shutil.copytree(qwen.folder, root / "no-vae-config")
    (no_config / "vae" / "config.json").unlink()
    no_weights = shutil.copytree(qwen.folder, root / "no-dit-weights")
    for path in (no_weights / "transformer").glob("*.safetensors"):
        path.unlink()
    server = serve(ServerConfig(host="127.0.0.1", port=0), ModelRegistry([root], None))
    try:
        r = server.call("GET", "models/no-mean/status")
        assert r.status_code == 400 and "latents_mean" in r.json()["error"], r.text
        r = server.call("GET", "models/no-vae-config/status")
        assert r.status_code == 400 and "config.json is missing" in r.json()["error"], r.text
        r = server.call("GET", "models/no-dit-weights/status")
        said = r.json()["error"]
        assert r.status_code == 400 and said.endswith(
            f"misconfigured: no safetensors weights in {no_weights / 'transformer'}"
        ), said
    finally:
        server.close()
