"""Runs: begin/end/interrupt, 32 and 429, idle end, interrupts of steps in flight, and the holds
that keep a model loaded (docs/contract.md §2.10, 3.2)."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from gmlx_contract import wire

from .conftest import CONTAINER, VERSION

X = np.zeros((1, 4, 2, 2), np.float32)
T = np.zeros(1, np.float32)


def begin(server, model=None):
    r = server.post_json("runs/begin", {} if model is None else {"model": model})
    assert r.status_code == 200, r.text
    return r.json()["run"]


def held_run(server):
    """A conditioning, a run and the model, whose steps wait until `model.release_steps()`."""
    cond = server.put_tensor(np.ones((1, 2, 8), np.float32))
    run = begin(server)
    model = server.model()
    model.hold_steps()
    return cond, run, model


def step_fields(server, cond, run=None):
    fields = {"rows": [{"cond": cond}]}
    if run is not None:
        fields["run"] = run
    return fields


def send_step(server, cond, run=None) -> requests.Response:
    # A session of its own: the shared one is not for concurrent use.
    body = wire.write_container({"x": X, "timestep": T}, step_fields(server, cond, run))
    return requests.post(
        server.url + "/step", data=body, headers={**VERSION, **CONTAINER}, timeout=30
    )


def test_begin_end_interrupt_basics(fresh):
    r = fresh.post_json("runs/begin", {"model": "alpha"})
    assert r.status_code == 200
    run = r.json()["run"]
    assert re.fullmatch(r"[0-9a-f]{16}", run) and r.json()["idle_s"] == 120.0
    assert fresh.post_json("interrupt", {"run": None}).json() == {"interrupted": 0}
    assert fresh.post_json("interrupt", {"run": "0" * 16}).json() == {"interrupted": 0}
    assert fresh.post_json("interrupt", {"run": run}).json() == {"interrupted": 1}
    assert fresh.post_json(f"runs/{run}/end", {}).json() == {"run": run, "ended": True}
    assert fresh.post_json(f"runs/{run}/end").json() == {"run": run, "ended": False}
    assert fresh.post_json("runs/unknown/end").json() == {"run": "unknown", "ended": False}
    assert fresh.post_json("interrupt", {"run": run}).json() == {"interrupted": 0}
    assert fresh.model().ended_runs == [run]


def test_begin_refusals(fresh):
    assert fresh.post_json("runs/begin", {"model": "ghost"}).status_code == 404
    assert fresh.post_json("runs/begin", {"model": "broken"}).status_code == 400
    assert fresh.post_json("runs/begin", {"model": 3}).status_code == 400
    assert fresh.ctx.service.run_count() == 0


@pytest.mark.parametrize("model", [False, 0, [], {}])
def test_a_model_that_names_nothing_but_is_no_string_is_400_not_the_default(fresh, model):
    cond = fresh.put_tensor(np.ones((1, 2, 8), np.float32))
    assert fresh.post_json("runs/begin", {"model": model}).status_code == 400
    # models/load answers any failure to resolve the id 404 (docs/contract.md §2)
    assert fresh.post_json("models/load", {"model": model}).status_code == 404
    run = begin(fresh)
    for on_run in (None, run):
        fields = {**step_fields(fresh, cond, on_run), "model": model}
        answer = fresh.post_container("step", {"x": X, "timestep": T}, fields)
        assert answer.status_code == 400 and "model must be a string" in answer.text
    assert fresh.ctx.service.run_count() == 1


def test_no_default_model_is_400(server_factory):
    server = server_factory(default_model=None)
    assert server.post_json("runs/begin", {}).status_code == 400
    assert (
        server.post_container(
            "step", {"x": X, "timestep": T}, {"rows": [{"cond": "a"}]}
        ).status_code
        == 400
    )


def test_thirty_third_run_is_429_and_holds_nothing(fresh):
    runs = [begin(fresh) for _ in range(32)]
    assert len(set(runs)) == 32
    r = fresh.post_json("runs/begin", {})
    assert r.status_code == 429 and isinstance(r.json()["error"], str)
    assert fresh.ctx.registry.holds("alpha") == 32
    fresh.post_json(f"runs/{runs[0]}/end")
    assert fresh.ctx.registry.holds("alpha") == 31
    begin(fresh)


def test_unload_is_busy_while_a_run_holds_the_model(fresh):
    run = begin(fresh)
    r = fresh.post_json("models/unload", {"model": "alpha"})
    assert r.status_code == 409
    assert r.json()["code"] == "busy" and r.json()["in_flight"] == 1
    fresh.post_json(f"runs/{run}/end")
    r = fresh.post_json("models/unload", {"model": "alpha"})
    assert r.json() == {"model": "alpha", "unloaded": True}
    assert fresh.post_json("models/unload", {"model": "alpha"}).json()["unloaded"] is False


def test_interrupt_of_a_step_in_flight(fresh):
    cond, run, model = held_run(fresh)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(send_step, fresh, cond, run)
        assert model.step_started.wait(10)
        # answered while the step still runs on the worker
        assert fresh.post_json("interrupt", {"run": run}).json() == {"interrupted": 1}
        assert not pending.done()
        model.release_steps()
        r = pending.result(30)
    assert r.status_code == 409 and r.json()["code"] == "interrupted"
    assert model.step_calls == 1  # it ran to completion, and was discarded
    again = send_step(fresh, cond, run)
    assert again.status_code == 409 and again.json()["code"] == "interrupted"
    assert model.step_calls == 1  # later steps never reach the model
    assert fresh.post_json(f"runs/{run}/end").json()["ended"] is True
    assert send_step(fresh, cond, run).status_code == 404


def test_end_of_a_run_with_a_step_in_flight(fresh):
    cond, run, model = held_run(fresh)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(send_step, fresh, cond, run)
        assert model.step_started.wait(10)
        assert fresh.post_json(f"runs/{run}/end").json()["ended"] is True
        model.release_steps()
        r = pending.result(30)
    assert r.status_code == 409 and r.json()["code"] == "interrupted"
    assert send_step(fresh, cond, run).status_code == 404


def test_a_queued_step_of_an_interrupted_run_is_not_computed(fresh):
    cond, run, model = held_run(fresh)
    with ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(send_step, fresh, cond)  # no run: occupies the worker
        assert model.step_started.wait(10)
        queued = pool.submit(send_step, fresh, cond, run)
        deadline = time.monotonic() + 10
        while fresh.ctx.service._runs[run].in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # let it reach the worker queue
        assert fresh.post_json("interrupt", {"run": run}).json() == {"interrupted": 1}
        model.release_steps()
        assert blocker.result(30).status_code == 200
        r = queued.result(30)
    assert r.status_code == 409 and r.json()["code"] == "interrupted"
    assert model.step_calls == 1


def test_idle_runs_end_and_let_the_model_go(server_factory):
    server = server_factory(run_idle_s=0.4, run_sweep_s=0.1)
    cond = server.put_tensor(np.ones((1, 2, 8), np.float32))
    run = begin(server)
    assert server.post_json("runs/begin", {}).json()["idle_s"] == 0.4
    assert send_step(server, cond, run).status_code == 200  # activity keeps it
    time.sleep(0.25)
    assert send_step(server, cond, run).status_code == 200
    deadline = time.monotonic() + 5
    while server.ctx.service.run_count() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.ctx.service.run_count() == 0
    assert send_step(server, cond, run).status_code == 404
    assert server.post_json("models/unload", {"model": "alpha"}).json()["unloaded"] is True


@pytest.mark.parametrize("refused", [{"dry_run": "yes"}, {"convention": 5}])
def test_a_refused_step_leaves_its_run_to_idle_out(server_factory, refused):
    """A step refused 400 on any field, `dry_run` included, counts no step in flight on its
    run: the run idles out and lets its model go."""
    server = server_factory(run_idle_s=0.3, run_sweep_s=0.1)
    cond = server.put_tensor(np.ones((1, 2, 8), np.float32))
    run = begin(server)
    fields = {**step_fields(server, cond, run), **refused}
    assert server.post_container("step", {"x": X, "timestep": T}, fields).status_code == 400
    deadline = time.monotonic() + 5
    while server.ctx.service.run_count() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.ctx.service.run_count() == 0
    assert server.post_json("models/unload", {"model": "alpha"}).json()["unloaded"] is True


def test_begin_sweeps_first(server_factory):
    server = server_factory(run_idle_s=0.2, run_sweep_s=3600)
    for _ in range(32):
        begin(server)
    time.sleep(0.3)
    begin(server)  # the 32 idle runs are swept by this begin, no 429
    assert server.ctx.service.run_count() == 1


def test_a_held_model_is_not_evicted_for_another(fresh):
    run = begin(fresh, "alpha")
    cond = fresh.put_tensor(np.ones((1, 2, 8), np.float32))
    r = fresh.post_container(
        "step", {"x": X, "timestep": T}, {"rows": [{"cond": cond}], "model": "beta"}
    )
    assert r.status_code == 503
    fresh.post_json(f"runs/{run}/end")
    r = fresh.post_container(
        "step", {"x": X, "timestep": T}, {"rows": [{"cond": cond}], "model": "beta"}
    )
    assert r.status_code == 200
    assert fresh.ctx.registry.resident_ids() == ["beta"]


def test_runs_are_logged_when_they_end(fresh, caplog):
    caplog.set_level("INFO", logger="gmlx.server")
    cond = fresh.put_tensor(np.ones((1, 2, 8), np.float32))
    run = begin(fresh)
    for _ in range(3):
        assert send_step(fresh, cond, run).status_code == 200
    fresh.post_json(f"runs/{run}/end")
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith(f"run {run} ended")
    ]
    assert lines and "3 steps, 3 rows" in lines[0] and "hit=2 miss=1" in lines[0]


def test_concurrent_clients_get_their_own_rows(fresh):
    conds = [np.full((1, 2, 8), i, np.float32) for i in range(4)]
    hashes = [fresh.put_tensor(c) for c in conds]
    barrier = threading.Barrier(4)

    def client(i):
        barrier.wait()
        outs = []
        for _ in range(5):
            r = send_step(fresh, hashes[i])
            outs.append(wire.read_container(r.content).tensors["out"].copy())
        return outs

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(client, range(4)))
    for i, outs in enumerate(results):
        for out in outs:
            np.testing.assert_array_equal(out, outs[0])
        assert not np.array_equal(outs[0], results[(i + 1) % 4][0])


def test_a_step_on_a_run_uses_the_runs_instance_without_the_worker(fresh, monkeypatch):
    """docs/contract.md §2.11 step 4 for a run: the run's loaded instance, no resolving, no worker job;
    a step naming no run (or another model) still resolves."""
    registry = fresh.ctx.registry
    acquired = []
    real_acquire = registry.acquire
    monkeypatch.setattr(
        registry, "acquire", lambda model_id: acquired.append(model_id) or real_acquire(model_id)
    )
    run = fresh.post_json("runs/begin", {"model": "alpha"}).json()["run"]
    loaded = registry.loaded("alpha")
    acquired.clear()
    cond = fresh.put_tensor(np.ones((1, 2, 8), np.float32))
    x, t = np.zeros((1, 4, 1, 1), np.float32), np.zeros(1, np.float32)
    for fields in ({"run": run}, {"run": run, "model": "alpha"}):
        r = fresh.post_container(
            "step", {"x": x, "timestep": t}, {"rows": [{"cond": cond}], **fields}
        )
        assert r.status_code == 200, r.text
    assert acquired == [] and registry.loaded("alpha") is loaded and loaded.holds == 1
    r = fresh.post_container("step", {"x": x, "timestep": t}, {"rows": [{"cond": cond}]})
    assert r.status_code == 200 and acquired == [None]
    fields = {"rows": [{"cond": cond}], "run": run, "model": "beta"}
    r = fresh.post_container("step", {"x": x, "timestep": t}, fields)
    assert acquired[-1] == "beta" and r.status_code == 503  # alpha is held by the run


def test_a_step_counts_on_its_run_under_the_service_lock(fresh, monkeypatch):
    from gmlx_server.service import Run

    service = fresh.ctx.service
    held = []
    real_record = Run.record

    def record(self, *args):
        held.append(service._lock.locked())
        real_record(self, *args)

    monkeypatch.setattr(Run, "record", record)
    run = fresh.post_json("runs/begin", {}).json()["run"]
    cond = fresh.put_tensor(np.ones((1, 2, 8), np.float32))
    x, t = np.zeros((1, 4, 1, 1), np.float32), np.zeros(1, np.float32)
    fields = {"rows": [{"cond": cond}], "run": run}
    assert fresh.post_container("step", {"x": x, "timestep": t}, fields).status_code == 200
    assert held == [True]


def test_a_stop_does_not_hang_on_a_job_the_worker_still_runs(fresh, caplog):
    """The worker busy with a job that does not end (a long load or pass): the stop gives up
    waiting after its wait (CLOSE_WAIT_S), says so, and
    returns; the models go with the process."""
    assert fresh.post_json("models/load", {"model": "alpha"}).status_code == 200
    release, started = threading.Event(), threading.Event()
    fresh.ctx.service.worker.submit(lambda: started.set() or release.wait(30))
    assert started.wait(10)
    began = time.monotonic()
    try:
        fresh.ctx.service.close(wait_s=0.3)
        assert time.monotonic() - began < 5
        assert "still busy 0.3 s into the stop" in caplog.text
        assert fresh.ctx.registry.resident_ids() == ["alpha"]  # left to the process's end
    finally:
        release.set()


def test_a_request_a_stop_cut_short_is_503_like_the_stops_others(fresh, caplog):
    """The worker stopped under a request (a stop at once lets the models go while a request
    still runs): the request is answered 503 with the stop's reason, not a 500 and a
    traceback."""
    caplog.set_level("INFO", logger="gmlx.server")
    assert fresh.post_json("models/load", {"model": "alpha"}).status_code == 200
    fresh.ctx.service.worker.stop()
    r = fresh.post_json("encode", {"text": "a cat"})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"].startswith("the server is stopping")
    assert "Traceback" not in caplog.text and "cut short by the stop" in caplog.text
