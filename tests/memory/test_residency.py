"""The text encoder's residency (`[server.image] encoder_residency`, server/memory.py) on the
embedded Qwen-Image 2.1 model: a released encoder frees its memory and loads again on the next
encode with the same conditioning; "release" drops it after every encode, "keep" never;
"auto" releases it exactly when a step would not fit beside it, and a step that does not fit
even then runs its rows one at a time, equal to the batched step. Status `residency` says what
is held."""

from __future__ import annotations

import gc
import math
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.qwen_image21 import family
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.memory import MiB

from tests.server.conftest import serve

embedded = pytest.importorskip("gmlx_server.engine.families.qwen_image21.embedded")

PROMPT = "a quiet harbour at dawn"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return embedded.ensure_embedded_model(tmp_path_factory.mktemp("embedded"))


@pytest.fixture(scope="module")
def servers(folder):
    """One server per residency, each serving the embedded folder."""
    started = {}
    for residency in ("keep", "release", "auto"):
        image = replace(ImageConfig(), encoder_residency=residency)
        config = ServerConfig(host="127.0.0.1", port=0, image=image)
        server = serve(config, ModelRegistry([], folder.name, extra_models=[folder]))
        server.model_id = folder.name
        started[residency] = server
    yield started
    for server in started.values():
        server.close()


def encode(server, text: str = PROMPT) -> tuple[str, np.ndarray]:
    r = server.post_json("encode", {"text": text})
    assert r.status_code == 200, r.text
    answer = wire.read_container(r.content)
    return answer.fields["cond"], answer.tensors["cond"]


def residency(server) -> dict:
    return server.call("GET", f"models/{server.model_id}/status").json()["residency"]


def model_of(server):
    return server.ctx.registry.loaded(server.model_id).model


def test_a_released_encoder_frees_its_memory_and_loads_again_with_the_same_conditioning(folder):
    """Loaded alone, its release frees the encoder's weights and nothing else (every family's
    release, served: tests/families/test_conformance.py)."""
    model = family.QWEN_IMAGE21.load(folder, "released")
    first = model.encode(PROMPT, [], refs=False).cond
    encoder_bytes, all_bytes = model.encoder_bytes, model.weight_bytes
    gc.collect()
    before = mx.get_active_memory()
    assert model.release_encoder() == encoder_bytes > 2 * MiB
    gc.collect()
    freed = before - mx.get_active_memory()
    assert encoder_bytes <= freed <= encoder_bytes * 1.01  # its weights, and nothing else held
    assert not model.encoder_resident and model.weight_bytes == all_bytes - encoder_bytes
    assert model.release_encoder() == 0  # released already
    again = model.encode(PROMPT, [], refs=False).cond
    assert model.encoder_resident and model.weight_bytes == all_bytes
    assert again.tobytes() == first.tobytes()
    model.close()


def test_release_drops_the_encoder_after_every_encode_with_the_conditioning_of_keep(servers):
    keep, release = servers["keep"], servers["release"]
    kept = encode(keep)
    assert residency(keep)["encoder"]["resident"] is True
    assert residency(keep)["encoder"]["policy"] == "keep"
    for _ in range(2):  # each encode loads the encoder again, and drops it after
        released = encode(release)
        assert released[0] == kept[0] and released[1].tobytes() == kept[1].tobytes()
        state = residency(release)
        assert state["encoder"]["resident"] is False and state["encoder"]["policy"] == "release"
        assert state["dit"]["resident"] and state["vae"]["resident"]
    model = model_of(release)
    assert model.weight_bytes == model_of(keep).weight_bytes - model.encoder_bytes


def test_status_reports_each_components_residency_bytes_and_precision(servers, folder):
    server = servers["auto"]
    server.post_json("models/unload", {"model": server.model_id})
    unloaded = residency(server)
    assert set(unloaded) == {"dit", "encoder", "vae"}
    assert not any(component["resident"] for component in unloaded.values())
    server.post_json("models/load", {"model": server.model_id})
    loaded = residency(server)
    model = model_of(server)
    assert loaded == {
        "dit": {
            "resident": True,
            "bytes": model.dit.weight_bytes,
            "dtype": "f32",
            "quantization": None,
        },
        "encoder": {
            "resident": True,
            "bytes": model.encoder_bytes,
            "dtype": "f32",
            "quantization": None,
            "policy": "auto",
        },
        "vae": {
            "resident": True,
            "bytes": model.vae.weight_bytes,
            "dtype": "f32",
            "quantization": None,
        },
    }
    # the headers' estimate: the DiT as it loads; the files of the encoder (lm_head) and of
    # the VAE (its temporal convolutions) also hold tensors that never load
    assert unloaded["dit"]["bytes"] == loaded["dit"]["bytes"]
    for name in ("encoder", "vae"):
        assert loaded[name]["bytes"] < unloaded[name]["bytes"] < 1.5 * loaded[name]["bytes"]


def put_cond(server, length: int, seed: int) -> tuple[str, StepRow]:
    rng = np.random.default_rng(seed)
    digest = server.put_tensor(rng.standard_normal((1, length, 128), dtype=np.float32))
    row = StepRow(server.ctx.service.tensors.get(digest).float32()[0], f"wire:{digest}")
    return digest, row


def step(server, x: np.ndarray, digests: list[str]):
    t = np.full((x.shape[0],), 0.5, np.float32)
    rows = [{"cond": d} for d in digests]
    return server.post_container("step", {"x": x, "timestep": t}, {"rows": rows})


def with_budget(server, budget_bytes: int, work):
    """Run work() under a memory budget of budget_bytes rounded up to whole MiB."""
    planner = server.ctx.service.memory
    saved = planner.budget_mb
    planner.budget_mb = math.ceil(budget_bytes / MiB)
    try:
        return work()
    finally:
        planner.budget_mb = saved


def fresh_state(server):
    """The encoder loaded (an encode), no prefix states held: the plan has only the encoder
    to release."""
    encode(server)
    model = model_of(server)
    server.ctx.service.worker.call(model.prefix_cache.clear)
    assert model.encoder_resident
    return model


def one_row_step(server, x: np.ndarray, length: int, seed: int):
    """The encoder loaded and no prefix states held (fresh_state), a conditioning of `length`
    rows put: (the model, the conditioning's digest, the need of a step of x on it, what the
    plan holds)."""
    model = fresh_state(server)
    digest, row = put_cond(server, length, seed)
    return model, digest, model.step_peak_bytes(x.shape, [row]), server.ctx.service.memory.held()


def short_of_both(held: int, need: int) -> int:
    """A budget a MiB short of what is held and the work's need together (in whole MiB, as a
    budget is)."""
    return (held + need) // MiB * MiB - MiB


def test_auto_releases_the_encoder_exactly_when_the_step_would_not_fit_beside_it(servers):
    server = servers["auto"]
    x = np.random.default_rng(0).standard_normal((1, 64, 32, 32), dtype=np.float32)
    model, digest, need, held = one_row_step(server, x, 64, 1)
    # room for both (the budget rounds up): the encoder stays
    r = with_budget(server, held + need, lambda: step(server, x, [digest]))
    assert r.status_code == 200, r.text
    assert model.encoder_resident

    model, digest, need, held = one_row_step(server, x, 64, 2)
    # a MiB short of both, but room for the step once the encoder goes
    budget = short_of_both(held, need)
    assert held - model.encoder_bytes + need <= budget < held + need
    r = with_budget(server, budget, lambda: step(server, x, [digest]))
    assert r.status_code == 200, r.text
    assert not model.encoder_resident and residency(server)["encoder"]["resident"] is False
    encode(server)  # the next encode loads it again
    assert model.encoder_resident


def test_keep_never_releases_and_refuses_instead(servers):
    server = servers["keep"]
    x = np.random.default_rng(0).standard_normal((1, 64, 32, 32), dtype=np.float32)
    model, digest, need, held = one_row_step(server, x, 64, 3)
    r = with_budget(server, short_of_both(held, need), lambda: step(server, x, [digest]))
    assert r.status_code == 400 and "memory plan" in r.json()["error"]
    assert model.encoder_resident


def test_a_step_that_does_not_fit_after_the_release_runs_its_rows_one_at_a_time(servers):
    server = servers["auto"]
    planner = server.ctx.service.memory
    x = np.random.default_rng(4).standard_normal((2, 64, 32, 32), dtype=np.float32)
    model = fresh_state(server)
    (first, one), (second, two) = put_cond(server, 48, 5), put_cond(server, 80, 6)
    both = model.step_peak_bytes(x.shape, [one, two])
    alone = max(model.step_peak_bytes((1, *x.shape[1:]), [row]) for row in (one, two))
    held = planner.held()
    # room for one row at a time once the encoder goes, not for the two together
    budget = held - model.encoder_bytes + alone + MiB
    assert budget < held - model.encoder_bytes + both
    apart = with_budget(server, budget, lambda: step(server, x, [first, second]))
    assert apart.status_code == 200, apart.text
    assert apart.headers["X-Gmlx-Prefix-Cache"] == "miss"
    assert not model.encoder_resident  # released first
    server.ctx.service.worker.call(model.prefix_cache.clear)
    together = step(server, x, [first, second])  # the server's own budget: room for both
    assert together.status_code == 200
    got = wire.read_container(apart.content).tensors["out"]
    want = wire.read_container(together.content).tensors["out"]
    assert np.array_equal(got, want)


def test_auto_releases_the_encoder_for_a_vae_pass_that_would_not_fit_beside_it(servers):
    server = servers["auto"]
    planner = server.ctx.service.memory
    model = fresh_state(server)
    z = np.random.default_rng(7).standard_normal((1, 64, 8, 8), dtype=np.float32)
    need, held = model.vae_peak_bytes(128, 128, True), planner.held()
    budget = short_of_both(held, need)
    assert held - model.encoder_bytes + need <= budget < held + need
    r = with_budget(server, budget, lambda: server.post_container("vae/decode", {"latents": z}))
    assert r.status_code == 200, r.text
    assert not model.encoder_resident


def test_work_that_would_not_fit_even_without_the_encoder_keeps_it(servers):
    """The quick plan (the target pass alone) passes, the detailed one (a long prefix built
    now) does not fit even with the encoder released: refused, the encoder kept."""
    server = servers["auto"]
    planner = server.ctx.service.memory
    model = fresh_state(server)
    digest, row = put_cond(server, 1500, 8)
    x = np.random.default_rng(9).standard_normal((2, 64, 16, 16), dtype=np.float32)
    held, encoder = planner.held(), model.encoder_bytes
    quick = model.step_peak_bytes((1, *x.shape[1:]), None)
    budget = held - encoder + quick + MiB
    assert model.step_peak_bytes((1, *x.shape[1:]), [row]) > budget - held + encoder + MiB
    r = with_budget(server, budget, lambda: step(server, x, [digest] * 2))
    assert r.status_code == 400 and "memory plan" in r.json()["error"], r.text
    assert "fit" in r.json()["error"] and model.encoder_resident
