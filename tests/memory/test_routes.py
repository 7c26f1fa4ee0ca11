"""Memory plans through the routes (docs/contract.md §3.5, 2.1, 2.3) on the embedded Qwen-Image 2.1 model
with a small configured budget: refusals with a hint, fitting work, shedding, status, bounds."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.memory import MIN_CACHE_FRACTION, MiB

from tests.server.conftest import serve

embedded = pytest.importorskip("gmlx_server.engine.families.qwen_image21.embedded")

BUDGET_MB = 64


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = embedded.ensure_embedded_model(tmp_path_factory.mktemp("embedded"))
    image = replace(ImageConfig(), memory_budget_mb=BUDGET_MB)
    config = ServerConfig(host="127.0.0.1", port=0, image=image)
    server = serve(config, ModelRegistry([], folder.name, extra_models=[folder]))
    server.model_id = folder.name
    yield server
    server.close()


def step(qwen, x: np.ndarray, conds: list[str], run: str | None = None):
    rows = [{"cond": c} for c in conds]
    t = np.full((x.shape[0],), 0.5, np.float32)
    return qwen.post_container("step", {"x": x, "timestep": t}, {"rows": rows, "run": run})


def cond(qwen, length: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return qwen.put_tensor(rng.standard_normal((1, length, 128), dtype=np.float32))


def latents(batch: int, side: int) -> np.ndarray:
    return np.random.default_rng(side).standard_normal((batch, 64, side, side), dtype=np.float32)


def test_a_fitting_step_passes_and_a_large_one_gets_400_with_what_fits(qwen):
    c = cond(qwen, 16, 0)
    assert step(qwen, latents(1, 8), [c]).status_code == 200
    r = step(qwen, latents(4, 96), [c] * 4)  # 1536x1536 pixels, 4 rows: far over 64 MiB
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert "memory plan does not fit" in message and f"{BUDGET_MB} MiB" in message
    assert "fit at up to" in message  # the largest square at these rows
    side = int(message.split("fit at up to ")[1].split("x")[0])
    assert 16 <= side < 96 * 16
    fits = step(qwen, latents(4, side // 16), [c] * 4)
    assert fits.status_code == 200, fits.text


# tests/memory/test_residency.py's step that does not fit after the encoder's release runs its
# rows one at a time through the same plan, at half the cost; this one runs with -m heavy.
@pytest.mark.heavy
def test_rows_that_do_not_fit_together_run_one_at_a_time(qwen):
    c = cond(qwen, 16, 1)
    assert qwen.post_json("models/load", {"model": qwen.model_id}).status_code == 200
    planner = qwen.ctx.service.memory
    model = qwen.ctx.registry.loaded(qwen.model_id).model
    free = planner.budget() - planner.held(states=False)
    side = next(s for s in range(8, 200, 4) if model.step_peak_bytes((2, 64, s, s), None) > free)
    if model.step_peak_bytes((1, 64, side, side), None) > free:
        pytest.skip("one row does not fit where two stop fitting")
    x = latents(2, side)
    apart = step(qwen, x, [c, c])
    assert apart.status_code == 200, apart.text
    saved = planner.budget_mb
    planner.budget_mb = 4096
    try:
        together = step(qwen, x, [c, c])
    finally:
        planner.budget_mb = saved
    assert together.status_code == 200
    got = wire.read_container(apart.content).tensors["out"]
    want = wire.read_container(together.content).tensors["out"]
    assert np.array_equal(got, want)


def test_vae_routes_refuse_what_does_not_fit_with_the_largest_size(qwen):
    z = np.zeros((1, 64, 64, 64), np.float32)  # a 1024x1024 decode: gigabytes on the CPU
    r = qwen.post_container("vae/decode", {"latents": z})
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert "decode's memory plan" in message and "images of up to" in message
    side = int(message.split("images of up to ")[1].split("x")[0])
    assert 16 <= side < 1024
    small = np.zeros((2, 64, side // 16, side // 16), np.float32)
    ok = qwen.post_container("vae/decode", {"latents": small})
    assert ok.status_code == 200, ok.text
    image = np.zeros((1, 1024, 1024, 3), np.float32)
    r = qwen.post_container("vae/encode", {"image": image})
    assert r.status_code == 400 and "encode's memory plan" in r.json()["error"]


def test_an_openai_image_is_planned_before_it_is_encoded(qwen, monkeypatch):
    """/v1/images/generations samples in process under the same plan as the step routes: an
    image whose steps do not fit is refused 400 with what fits, before its prompt is encoded."""
    loaded = qwen.ctx.registry.acquire(qwen.model_id)
    qwen.ctx.registry.release(loaded)
    model = loaded.model

    def no_encode(*args, **kwargs):
        raise AssertionError("the prompt was encoded before the plan")

    monkeypatch.setattr(model, "encode", no_encode)
    doc = {"prompt": "a red fox", "size": "1536x1536", "model": qwen.model_id}
    r = qwen.session.post(qwen.base + "/v1/images/generations", json=doc, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "step's memory plan does not fit" in message and f"{BUDGET_MB} MiB" in message
    assert "fit at up to" in message


def test_status_memory_keys_and_cache_bounds(qwen):
    qwen.post_json("models/load", {"model": qwen.model_id})
    memory = qwen.call("GET", f"models/{qwen.model_id}/status").json()["memory"]
    files = memory["dit_bytes"] + memory["encoder_bytes"] + memory["vae_bytes"]
    assert memory["activation_reserve_bytes"] > 0
    assert memory["resident_bytes"] >= files + memory["activation_reserve_bytes"]
    # the tiny model's plan (a 1024x1024 reference workload) leaves no room in 64 MiB
    limits = qwen.call("GET", "capabilities", versioned=False).json()["limits"]
    assert limits["max_tensor_bytes"] == 64 * MiB // MIN_CACHE_FRACTION
    assert limits["max_adapter_bytes"] == 256 * MiB // MIN_CACHE_FRACTION
    r = qwen.post_json("models/unload", {"model": qwen.model_id})
    assert r.json()["unloaded"] is True
    memory = qwen.call("GET", f"models/{qwen.model_id}/status").json()["memory"]
    assert memory["resident_bytes"] == 0 and memory["activation_reserve_bytes"] > 0
    limits = qwen.call("GET", "capabilities", versioned=False).json()["limits"]
    # no model: the caches share the whole budget in their configured proportion (64:256 MiB)
    assert limits["max_tensor_bytes"] == max(
        64 * MiB // MIN_CACHE_FRACTION, BUDGET_MB * MiB * 64 // 320
    )
    assert limits["max_adapter_bytes"] == max(
        256 * MiB // MIN_CACHE_FRACTION, BUDGET_MB * MiB * 256 // 320
    )


def test_the_detailed_plan_sheds_states_of_finished_work(qwen):
    service = qwen.ctx.service
    planner = service.memory
    x = latents(1, 8)
    saved = planner.budget_mb
    planner.budget_mb = 4096  # room for the uploads first (the 64 MiB plan lowers the bounds)
    planner.fit_cache_bounds()
    finished = [cond(qwen, 1500, 10 + i) for i in range(3)]
    for c in finished:  # no run: the states of finished work stay, unpinned
        assert step(qwen, x, [c]).status_code == 200
    model = qwen.ctx.registry.loaded(qwen.model_id).model
    states = model.prefix_cache.total_bytes
    assert states > 0 and model.prefix_cache.unpinned_bytes == states
    new = cond(qwen, 1500, 20)
    # what the plan will count: a state built now
    row = StepRow(service.tensors.get(new).float32()[0], f"wire:{new}")
    need = model.step_peak_bytes(x.shape, [row])
    held = planner.held()
    try:
        # free < need, but free + the held states >= need: the plan sheds, the step runs
        planner.budget_mb = -(-(held + need - states // 2) // MiB)
        assert planner.budget() - held < need
        r = step(qwen, x, [new])
        assert r.status_code == 200, r.text
        assert model.prefix_cache.total_bytes < states + model.step_peak_bytes(x.shape, [row])
        assert any(model.prefix_cache.get(k) is None for k in _keys(model, finished, x))
        # a budget nothing fits in: 400
        planner.budget_mb = 1
        r = step(qwen, x, [cond(qwen, 1500, 30)])
        assert r.status_code == 400 and "memory plan" in r.json()["error"]
    finally:
        planner.budget_mb = saved
        planner.fit_cache_bounds()


def _keys(model, digests, x):
    return [
        next(
            iter(
                model.step_keys(x.shape, [StepRow(np.zeros((1500, 128), np.float32), f"wire:{d}")])
            )
        )
        for d in digests
    ]


def test_mlx_is_asked_once_at_construction_never_per_plan(qwen, monkeypatch):
    """The device facts are read when the planner is built (before serving); plans on HTTP
    threads use plain values, and the model's plan asks no MLX call off the worker."""
    from gmlx_server import memory
    from gmlx_server.engine.nn import cpu_ops

    asked = []
    monkeypatch.setattr(memory, "_mlx_gpu_bytes", lambda: asked.append(1) or 0)
    planner = memory.MemoryPlanner(qwen.ctx.registry, [], ImageConfig())
    for _ in range(3):
        assert planner.budget() > 0
    assert asked == [1]

    threads = []
    real = cpu_ops.use_cpu_ops
    monkeypatch.setattr(
        cpu_ops, "use_cpu_ops", lambda d: threads.append(threading.current_thread()) or real(d)
    )
    assert step(qwen, latents(1, 2), [cond(qwen, 4, 1)]).status_code == 200
    worker = qwen.ctx.service.worker._thread
    assert all(thread is worker for thread in threads)


def test_the_machine_is_read_once_per_plan(qwen):
    from gmlx_server.engine.base import MemoryPlanError
    from gmlx_server.memory import MemoryPlanner

    reads = []
    config = replace(ImageConfig(), memory_budget_mb=0, memory_headroom_mb=0)
    planner = MemoryPlanner(qwen.ctx.registry, [], config, machine=lambda: reads.append(1) or MiB)
    assert step(qwen, latents(1, 2), [cond(qwen, 4, 2)]).status_code == 200
    loaded = qwen.ctx.registry.loaded(qwen.model_id)
    with pytest.raises(MemoryPlanError):
        planner.check_step_quick(loaded, (1, 64, 64, 64))
    assert len(reads) == 1
    reads.clear()
    with pytest.raises(MemoryPlanError):
        planner.check_vae(loaded, 1024, 1024, True)
    assert len(reads) == 1


def test_a_step_plans_its_rows_once(qwen, monkeypatch):
    """plan_row runs once per row of a step: the memory plan's plan goes on to the forward."""
    from gmlx_server.engine.families.qwen_image21 import family
    from gmlx_server.engine.families.qwen_image21 import step as step_module

    planned = []
    real = step_module.plan_row

    def counting(*args):
        planned.append(1)
        return real(*args)

    monkeypatch.setattr(family, "plan_row", counting)
    monkeypatch.setattr(step_module, "plan_row", counting)
    conds = [cond(qwen, 4, 30), cond(qwen, 5, 31)]
    assert step(qwen, latents(2, 2), conds).status_code == 200
    assert len(planned) == 2


def test_vae_decode_plans_memory_before_checking_alpha(qwen, monkeypatch):
    """docs/contract.md §2.12: the memory plan is checked before `alpha` on a VAE without alpha."""
    assert step(qwen, latents(1, 2), [cond(qwen, 4, 40)]).status_code == 200  # loaded
    loaded = qwen.ctx.registry.loaded(qwen.model_id)
    no_alpha = replace(loaded.facts, vae_channels_out=3)  # as if its VAE had no alpha channel
    monkeypatch.setattr(loaded, "facts", no_alpha)
    large = np.zeros((1, 64, 64, 64), np.float32)
    r = qwen.post_container("vae/decode", {"latents": large}, {"alpha": True})
    assert r.status_code == 400 and "decode's memory plan" in r.json()["error"], r.text
    small = np.zeros((1, 64, 1, 1), np.float32)
    r = qwen.post_container("vae/decode", {"latents": small}, {"alpha": True})
    assert r.status_code == 400 and "no alpha channel" in r.json()["error"], r.text


def test_a_run_step_of_an_unchanged_shape_skips_only_the_quick_plan(qwen, monkeypatch):
    planner = qwen.ctx.service.memory
    quick = []
    original = planner.check_step_quick
    monkeypatch.setattr(planner, "check_step_quick", lambda *a: quick.append(a) or original(*a))
    c = cond(qwen, 16, 30)
    run = qwen.post_json("runs/begin", {"model": qwen.model_id}).json()["run"]
    for side in (8, 8, 12, 12):
        assert step(qwen, latents(1, side), [c], run).status_code == 200
    assert [args[1] for args in quick] == [(1, 64, 8, 8), (1, 64, 12, 12)]
    monkeypatch.setattr(planner, "budget_mb", 1)  # memory gone: the detailed plan still refuses
    r = step(qwen, latents(1, 12), [c], run)
    assert r.status_code == 400 and "memory plan does not fit" in r.json()["error"]
    assert len(quick) == 2
    assert step(qwen, latents(1, 12), [c]).status_code == 400  # no run: the quick plan refuses
    assert len(quick) == 3
