"""FLUX.2 klein through the whole seam over HTTP on tiny folders found by the product registry
(its spec.py): the family's facts in its status and manifest (read from the files against
the loaded model's: tests/families/test_conformance.py), encode with references, steps equal
to the diffusers transformer (joint references, and the KV model's), the run's reference
K/V cache (a hit equals the miss, the memory plan counts it and refuses one that does not fit)
(the VAE routes in model space, and a LoRA table against the checkpoint with it merged, on this
family's LORA_LAYERS: tests/families/test_conformance.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.families.flux2_klein.family import ref_state_bytes
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import direct_row

from tests.compare import rel_l2
from tests.families.flux2_klein.reference import reference_dit
from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.server.conftest import out_of, serve

KLEIN, KV = "klein-tiny", "klein-kv-tiny"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2_seam")
    transformers = {
        KLEIN: build_tiny_folder(root / KLEIN, family="flux2_klein"),
        KV: build_tiny_folder(root / KV, family="flux2_klein_9b_kv", num_single_layers=1),
    }
    config = replace(ServerConfig(host="127.0.0.1", port=0), model_dirs=[root])
    config = replace(config, image=ImageConfig())
    server = serve(config, ModelRegistry([root], KLEIN, max_resident=2))
    server.transformers = transformers
    yield server
    server.close()


def encode(live, text: str, model: str = KLEIN) -> np.ndarray:
    r = live.post_json("encode", {"model": model, "text": text})
    assert r.status_code == 200, r.text
    return wire.read_container(r.content).tensors["cond"]


def latents(seed: int, *shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def step(live, x, sigmas, rows, model=KLEIN, **fields):
    wired = []
    for cond, refs in rows:
        row = {"cond": live.put_tensor(cond)}
        if refs:
            row["ref_latents"] = [live.put_tensor(r[None]) for r in refs]
        wired.append(row)
    doc = {"model": model, "rows": wired, **fields}
    return live.post_container("step", {"x": x, "timestep": np.asarray(sigmas, np.float32)}, doc)


def test_status_and_manifest_say_the_familys_facts(live):
    unloaded = live.call("GET", f"models/{KLEIN}/status").json()
    assert (unloaded["family"], unloaded["variant"]) == ("flux2_klein", "distilled")
    assert unloaded["comfy"] == {"model_class": "Flux2", "image_model": "flux2"}
    assert unloaded["latent"] == {"channels": 128, "stride": 16, "patch": 1}
    assert unloaded["vae"] == {"channels_out": 3, "stride": 16, "space": "model"}
    assert unloaded["edit_capable"] is True
    assert unloaded["conditioning"] == {
        "ref_method": "index",
        "empty_prompt": "",
        "inpaint_mask": "bilinear",
        "inpaint_reference": True,
        "reference_sizes": {
            "min_side": 64,
            "max_side": None,
            "max_aspect": 8,
            "min_area": 0,
            "max_area": 1024 * 1024,
            "lone_max_area": None,
            "lone_fit": "crop",
            "side_multiple": None,
        },
    }
    assert unloaded["sampling"]["schedule"] == {"rule": "flux2"}
    manifest = live.call("GET", f"models/{KLEIN}/manifest").json()
    names = {t["name"]: t["shape"] for t in manifest["tensors"]}
    assert names["transformer_blocks.0.attn.to_q.weight"] == [64, 64]  # unfused diffusers names
    assert names["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"] == [576, 64]
    assert manifest["family"] == "flux2_klein"
    kv = live.call("GET", f"models/{KV}/status").json()
    assert (kv["family"], kv["variant"]) == ("flux2_klein_9b_kv", "distilled")
    caps = live.call("GET", "capabilities", versioned=False).json()
    assert "ref_cache" in caps["features"]


# Both conventions read the timestep as sigma here; the reference one runs with -m heavy.
@pytest.mark.parametrize(
    "convention", ["comfy", pytest.param("reference", marks=pytest.mark.heavy)]
)
def test_step_is_the_transformers_velocity(live, convention):
    """Timestep = sigma, out = transformer(x, sigma): a row with two references of their own
    sizes after the image tokens, and a row of another prompt without any, in one step."""
    conds = [encode(live, "a red fox"), encode(live, "")]
    refs = [latents(2, 128, 4, 6), latents(3, 128, 2, 4)]
    x = latents(1, 2, 128, 3, 5)
    sigmas = np.array([0.8, 0.35], np.float32)
    r = step(live, x, sigmas, [(conds[0], refs), (conds[1], [])], convention=convention)
    assert r.headers["X-Gmlx-Prefix-Cache"] == "none"
    out = out_of(r)
    model = live.transformers[KLEIN]
    assert rel_l2(out[:1], reference_dit(model, x[:1], sigmas[:1], conds[0], refs)) <= 1e-4
    assert rel_l2(out[1:], reference_dit(model, x[1:], sigmas[1:], conds[1])) <= 1e-4


def test_the_kv_model_runs_its_references_its_own_way(live):
    """The KV family under the reference convention: its pipeline's extract step (references
    first, at time 0, attending to themselves); ref_cache is refused there."""
    cond = encode(live, "a red fox", KV)
    refs = [latents(4, 128, 4, 4), latents(5, 128, 2, 6)]
    x = latents(6, 1, 128, 4, 4)
    out = out_of(step(live, x, [0.6], [(cond, refs)], model=KV, convention="reference"))
    expected = reference_dit(live.transformers[KV], x, [0.6], cond, refs, kv=True)
    assert rel_l2(out, expected) <= 1e-4
    run = live.post_json("runs/begin", {"model": KV}).json()["run"]
    fields = {"model": KV, "convention": "reference", "run": run}
    r = step(live, x, [0.6], [(cond, refs)], **fields, ref_cache=True)
    assert r.status_code == 400 and "steps in parts under the reference convention" in r.text
    # refused at the route's step 8, before step 9's 409 for a tensor the server lacks
    unknown = {"cond": "0" * 64, "ref_latents": []}
    arrays = {"x": x, "timestep": np.array([0.6], np.float32)}
    r = live.post_container("step", arrays, {**fields, "ref_cache": True, "rows": [unknown]})
    assert r.status_code == 400 and "steps in parts" in r.text
    # its step in parts: the run keeps the references' K/V as the row's state
    first = step(live, x, [0.6], [(cond, refs)], **fields)
    second = step(live, x, [0.3], [(cond, refs)], **fields)
    headers = [r.headers["X-Gmlx-Prefix-Cache"] for r in (first, second)]
    assert headers == ["miss", "hit"]
    np.testing.assert_array_equal(out_of(first), out)
    expected = reference_dit(live.transformers[KV], x, [0.3], cond, refs, kv=True)
    assert rel_l2(out_of(second), expected) <= 1e-4
    row = {"cond": live.put_tensor(cond), "prefix_cache": False}
    row["ref_latents"] = [live.put_tensor(r[None]) for r in refs]
    arrays = {"x": x, "timestep": np.array([0.3], np.float32)}
    off = live.post_container("step", arrays, {**fields, "rows": [row]})
    assert off.headers["X-Gmlx-Prefix-Cache"] == "off"
    np.testing.assert_array_equal(out_of(off), out_of(second))
    live.post_json(f"runs/{run}/end")


def test_a_cached_step_equals_the_uncached_one(live):
    """ref_cache: the first step of the run extracts the references' K/V (miss), later steps
    reuse them (hit) and answer the same bit for bit, equal to the KV pipeline's extract step;
    ending the run drops them."""
    assert live.post_json("models/load", {"model": KLEIN}).status_code == 200
    model = live.ctx.registry.loaded(KLEIN)
    held = model.model.held_bytes()
    cond = encode(live, "a red fox")
    refs = [latents(7, 128, 4, 4), latents(8, 128, 4, 2)]
    x = latents(9, 2, 128, 3, 3)
    rows = [(cond, refs), (encode(live, ""), refs)]
    run = live.post_json("runs/begin", {"model": KLEIN}).json()["run"]
    fields = {"run": run, "ref_cache": True}
    first = step(live, x, [0.9, 0.9], rows, **fields)
    assert first.headers["X-Gmlx-Prefix-Cache"] == "miss"
    grown = model.model.held_bytes() - held
    assert grown == 2 * ref_state_bytes(model.model.dit.config, 4, 16 + 8)
    second = step(live, x, [0.9, 0.9], rows, **fields)
    assert second.headers["X-Gmlx-Prefix-Cache"] == "hit"
    np.testing.assert_array_equal(out_of(first), out_of(second))
    expected = reference_dit(live.transformers[KLEIN], x[:1], [0.9], cond, refs, kv=True)
    assert rel_l2(out_of(second)[:1], expected) <= 1e-4
    plain = out_of(step(live, x, [0.9, 0.9], rows))
    assert rel_l2(out_of(second), plain) > 0.01  # the KV way is not the joint one
    no_refs = step(live, x[:1], [0.5], [(cond, [])], **fields)
    assert no_refs.headers["X-Gmlx-Prefix-Cache"] == "none"
    live.post_json(f"runs/{run}/end")
    live.ctx.service.worker.call(lambda: None)  # the run's end is queued behind its work
    assert model.model.held_bytes() == held
    r = step(live, x[:1], [0.5], [(cond, refs)], ref_cache=True)
    assert r.status_code == 400 and "run" in r.text


def test_the_memory_plan_refuses_a_cache_that_does_not_fit(live, monkeypatch):
    """A budget with room for the step but not for the K/V it would keep, even with the text
    encoder released: the ref_cache step is refused 400, the same step without the cache
    runs."""
    assert live.post_json("models/load", {"model": KLEIN}).status_code == 200
    loaded = live.ctx.registry.loaded(KLEIN)
    cond = encode(live, "a red fox")
    refs = [latents(10, 128, 8, 8)]
    x = latents(11, 1, 128, 4, 4)
    row = direct_row(
        type("E", (), {"cond": cond, "ref_latents": [refs[0][None]], "image_slots": []})
    )
    memory = live.ctx.service.memory
    peak = loaded.model.step_peak_bytes(x.shape, [row])
    cache = ref_state_bytes(loaded.model.dit.config, 4, 64)
    run = live.post_json("runs/begin", {"model": KLEIN}).json()["run"]
    assert step(live, x, [0.5], [(cond, refs)], run=run).status_code == 200  # uploads them
    monkeypatch.setattr(memory, "budget_mb", 0)
    monkeypatch.setattr(memory, "headroom", 0)
    # the text encoder's bytes counted free: the plan may release it, and still it does not fit
    machine = memory.held() - loaded.model.encoder_bytes + peak + cache // 2
    monkeypatch.setattr(memory, "machine", lambda: machine)
    r = step(live, x, [0.5], [(cond, refs)], run=run, ref_cache=True)
    assert r.status_code == 400 and "memory plan" in r.text, r.text
    assert step(live, x, [0.5], [(cond, refs)], run=run).status_code == 200
    live.post_json(f"runs/{run}/end")


def test_encode_gives_references_as_vae_latents(live):
    image = np.random.default_rng(12).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    fields = {"model": KLEIN, "text": "a red fox"}
    r = live.post_container("encode", {"image_0": image}, fields)
    assert r.status_code == 200, r.text
    answer = wire.read_container(r.content)
    assert answer.fields["image_slots"] == [] and len(answer.fields["ref_latents"]) == 1
    ref = answer.tensors["ref_0"]
    r = live.post_container(
        "vae/encode", {"image": image[None] / np.float32(255)}, {"model": KLEIN}
    )
    np.testing.assert_array_equal(ref, wire.read_container(r.content).tensors["latents"])
    np.testing.assert_array_equal(answer.tensors["cond"], encode(live, "a red fox"))
    r = live.post_container("encode", {"image_0": image}, {**fields, "refs": False})
    assert wire.read_container(r.content).fields["ref_latents"] == []
    small = np.zeros((48, 64, 3), np.uint8)
    r = live.post_container("encode", {"image_0": small}, fields)
    assert r.status_code == 400 and "at least 64" in r.text
