"""The twin-blocks family through the whole seam over HTTP: the family handed to the registry
below is its only tie to the server. Status and manifest unloaded and loaded, encode, steps
(memory-planned, no prefix cache) and a LoRA key outside the tree (the VAE routes, and a table
against the checkpoint with it merged: tests/families/test_conformance.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.hashing import tensor_hash
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.registry import ModelRegistry

from tests.lora.over_http import put_table
from tests.server.conftest import out_of, serve

from . import checkpoint, family

REGISTRY_LINE = {family.SPEC.name: family.TWIN_BLOCKS}  # the family as the registry takes it


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("twin")
    checkpoint.write_folder(root, "twin-tiny")
    config = replace(ServerConfig(host="127.0.0.1", port=0), model_dirs=[root])
    config = replace(config, image=ImageConfig())
    server = serve(
        config, ModelRegistry([root], "twin-tiny", families=REGISTRY_LINE, max_resident=2)
    )
    yield server
    server.close()


def step(live, model: str, x, sigma: float, cond_hash: str, table: str | None = None):
    fields = {"model": model, "rows": [{"cond": cond_hash}], "patch_table": table}
    timestep = np.array([sigma], np.float32)
    return live.post_container("step", {"x": x, "timestep": timestep}, fields)


def test_status_and_manifest_read_unloaded_then_loaded(live):
    unloaded = live.call("GET", "models/twin-tiny/status").json()
    assert unloaded["family"] == "twin_blocks" and unloaded["resident"] is False
    assert unloaded["sampling"]["schedule"] == {"rule": "flux2"}
    manifest = live.call("GET", "models/twin-tiny/manifest").json()
    names = {t["name"]: t["shape"] for t in manifest["tensors"]}
    assert names["double_blocks.0.img_attn.to_q.weight"] == [64, 64]  # logical, unfused names
    assert names["single_blocks.1.mlp.down.weight"] == [64, 128]
    assert live.post_json("models/load", {"model": "twin-tiny"}).status_code == 200
    loaded = live.call("GET", "models/twin-tiny/status").json()
    assert loaded["resident"] is True
    # (the status and manifest from the files against loaded: tests/families/test_conformance.py)
    model = live.model("twin-tiny")
    stored = sum(t["shape"][0] * t["shape"][1] for t in manifest["tensors"] if len(t["shape"]) == 2)
    assert model.weight_bytes >= 4 * stored  # counted from the arrays, every weight there


def test_encode_then_step_answers_the_dit_with_no_prefix_cache(live):
    r = live.post_json("encode", {"model": "twin-tiny", "text": "two kinds of blocks"})
    assert r.status_code == 200, r.text
    cond = wire.read_container(r.content).tensors["cond"]
    assert cond.shape[0] == 1 and cond.shape[2] == 32 and cond.shape[1] > 4  # Qwen3's rows
    x = np.random.default_rng(1).standard_normal((1, 16, 3, 5)).astype(np.float32)
    r = step(live, "twin-tiny", x, 0.7, live.put_tensor(cond))
    out = out_of(r)
    assert out.shape == x.shape and np.all(np.isfinite(out))
    assert r.headers["X-Gmlx-Prefix-Cache"] == "none"
    other = out_of(step(live, "twin-tiny", x, 0.3, live.put_tensor(cond)))
    assert not np.allclose(out, other)  # the timestep reaches the DiT


def test_references_are_refused_as_the_capabilities_say(live):
    cond = live.put_tensor(np.ones((1, 3, 32), np.float32))
    ref = live.put_tensor(np.ones((1, 16, 2, 2), np.float32))
    x = np.zeros((1, 16, 2, 2), np.float32)
    fields = {"model": "twin-tiny", "rows": [{"cond": cond, "ref_latents": [ref]}]}
    r = live.post_container("step", {"x": x, "timestep": np.array([0.5], np.float32)}, fields)
    assert r.status_code == 400, r.text


def test_a_key_outside_the_tree_is_refused_naming_a_layer_that_is(live):
    up, down = np.ones((64, 1), np.float32), np.ones((1, 64), np.float32)
    patch = {"up": tensor_hash(up), "down": tensor_hash(down), "alpha": None, "strength": 1.0}
    entry = {"key": "diffusion_model.blocks.0.attn.to_q.weight", "band": None}
    adapters = {tensor_hash(up): up, tensor_hash(down): down}
    r, _ = put_table(live, "twin-tiny", [{**entry, "patches": [patch]}], adapters)
    assert r.status_code == 400 and "double_blocks.0.img_attn.to_q" in r.json()["error"]


def test_sampling_through_the_routes_equals_sampling_in_process(tmp_path):
    """The in-process sampler on the family (its flux2 schedule from gmlx_contract.schedules,
    guidance, decoding through `vae_space`) equals the same sampling through the step routes,
    bit for bit."""
    from gmlx_contract.client import StepClient
    from gmlx_server.engine.sampling import ImageRequest, generate
    from gmlx_server.model_choice import ModelChoice
    from gmlx_server.step_server import StepServer, ViaStepsTransport

    folder = checkpoint.write_folder(tmp_path, "twin-sampled", seed=6)
    registry = ModelRegistry(
        extra_models=[folder], default_model=folder.name, families=REGISTRY_LINE
    )
    request = ImageRequest(prompt="a boat", negative="fog", width=32, height=24, seed=2, cfg=3.0)
    with StepServer(ModelChoice(registry, folder.name, 0.0)) as server:
        server.load()
        model = server.loaded.model
        status = model.status()
        with StepClient(server.base_url) as client:
            via = ViaStepsTransport(client, server.direct(), folder.name)
            through_routes, _ = generate(via, status, request)
        direct, _ = generate(server.direct(), status, request)
        image = server.direct().decode(direct)
    assert len(via.transport_ms) == status["sampling"]["steps"]
    assert through_routes.shape == (1, 16, 3, 4)
    np.testing.assert_array_equal(through_routes, direct)
    assert np.std(direct) > 0.01  # latents that the steps moved, not an empty equality
    assert image.shape == (24, 32, 3) and 0.0 <= image.min() and image.max() <= 1.0
