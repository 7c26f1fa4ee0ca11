"""Faults: clients that vanish mid-upload and mid-step, a server restart in the middle of a
sampling, an interrupt storm, slow clients holding connections, and unloads during runs."""

from __future__ import annotations

import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.client import StepClient, digest_of
from gmlx_contract.errors import StepError
from gmlx_server.app import ServerThread, build_context, create_app, waitress_options
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.http_gate import gated_server

from ..server import linear_family
from ..server.conftest import LiveServer, model_root

STEPS = "/internal/image-steps/v1"


def address(server) -> tuple[str, int]:
    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def serve_on(tmp, port: int = 0, **adjust) -> LiveServer:
    """A test-family server on a given port (0: any), Waitress options adjustable."""
    root = model_root(tmp)
    config = replace(ServerConfig(host="127.0.0.1"), model_dirs=[root], image=ImageConfig())
    registry = ModelRegistry([root], "alpha", families={linear_family.FAMILY: linear_family.LINEAR})
    ctx = build_context(config, registry)
    options = {**waitress_options(config), **adjust}
    server = gated_server(create_app(ctx), host="127.0.0.1", port=port, **options)
    thread = ServerThread(server).start()
    return LiveServer(f"http://127.0.0.1:{thread.port}", ctx, thread)


def a_step_works(server) -> None:
    cond = np.full((1, 2, 8), 0.5, np.float32)
    x = np.ones((1, 4, 2, 2), np.float32)
    with StepClient(server.base) as client:
        out = client.step(x, [0.5], [{"cond": digest_of(cond)}], uploads={digest_of(cond): cond})
    assert np.array_equal(out.out[0], linear_family.row_output(x[0], 0.5, cond[0]))
    assert server.ctx.service.worker.alive


def open_channels(server) -> int:
    return len(server.thread.server.active_channels)


def wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---------------------------------------------------------------- vanishing clients


def test_clients_vanishing_mid_upload_leave_nothing_behind(fresh):
    array = np.arange(256 * 1024, dtype=np.float32)
    body = wire.write_container({"t": array})
    digest = digest_of(array)
    head = (
        f"PUT {STEPS}/tensors/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: {wire.CONTAINER_TYPE}\r\nX-Gmlx-Steps-Contract: 1.0\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    for cut in np.linspace(0, len(body) - 1, 20).astype(int):
        with socket.create_connection(address(fresh)) as sock:
            sock.sendall(head + body[:cut])
    assert wait_for(lambda: open_channels(fresh) == 0)
    assert fresh.call("HEAD", f"tensors/{digest}").status_code == 404
    assert len(fresh.ctx.service.tensors) == 0
    a_step_works(fresh)


def test_a_client_vanishing_mid_step_does_not_hurt_the_run(fresh):
    cond = np.ones((1, 2, 8), np.float32)
    with StepClient(fresh.base) as client:
        digest = client.put_tensor(cond)
        run = client.begin_run("alpha")
    body = wire.write_container(
        {"x": np.ones((1, 4, 2, 2), np.float32), "timestep": np.ones(1, np.float32)},
        {"rows": [{"cond": digest}], "run": run},
    )
    head = (
        f"POST {STEPS}/step HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: {wire.CONTAINER_TYPE}\r\nX-Gmlx-Steps-Contract: 1.0\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    model = fresh.model()
    for _ in range(5):
        model.hold_steps()
        with socket.create_connection(address(fresh)) as sock:
            sock.sendall(head + body)
            assert model.step_started.wait(10)  # the step is computing; the client goes
        model.release_steps()
    run_state = fresh.ctx.service._runs[run]
    assert wait_for(lambda: run_state.in_flight == 0 and run_state.steps == 5)
    assert wait_for(lambda: open_channels(fresh) == 0)
    with StepClient(fresh.base) as client:
        client.step(np.ones((1, 4, 2, 2), np.float32), [1.0], [{"cond": digest}], run=run)
        assert client.end_run(run)
    a_step_works(fresh)


# ---------------------------------------------------------------- restart mid-sampling


def lora_table(client: StepClient):
    up, down = np.full((4, 1), 0.5, np.float32), np.full((1, 4), 0.25, np.float32)
    adapters = {digest_of(up): up, digest_of(down): down}
    doc = {
        "model": "alpha",
        "entries": [
            {
                "key": "diffusion_model.proj.weight",
                "band": None,
                "patches": [{"up": digest_of(up), "down": digest_of(down), "strength": 0.5}],
            }
        ],
    }
    return client.put_patch_table(doc, "alpha", adapters)


def sample(client: StepClient, steps: int, restart_at: int | None = None, restart=None):
    """A table-patched sampling in a run; at `restart_at` the server restarts. The run is then
    unknown (404): begin another and go on; the step's 409 `missing` (conditioning and table)
    is answered by the client re-uploading, and the retried step succeeds."""
    rng = np.random.default_rng(3)
    cond = rng.standard_normal((1, 5, 8)).astype(np.float32)
    digest = digest_of(cond)
    x = rng.standard_normal((2, 4, 4, 4)).astype(np.float32)
    table = lora_table(client)
    run = client.begin_run("alpha")
    retried = 0
    for i in range(steps):
        if i == restart_at:
            restart()
        t = np.full(2, 1.0 - i / steps, np.float32)
        rows = [{"cond": digest}, {"cond": digest, "num_tokens": 3}]
        try:
            answer = client.step(x, t, rows, run=run, patch_table=table, uploads={digest: cond})
        except StepError as error:
            assert error.status == 404 and "run" in str(error)  # the restarted server's answer
            run = client.begin_run("alpha")
            answer = client.step(x, t, rows, run=run, patch_table=table, uploads={digest: cond})
        retried += answer.retried
        x = (x - np.float32(0.05) * answer.out).astype(np.float32)
    client.end_run(run)
    return x, retried


def test_a_server_restart_mid_sampling_is_recovered(tmp_path):
    first = serve_on(tmp_path / "a")
    port = address(first)[1]
    with StepClient(first.base) as client:
        reference, retried = sample(client, 12)
    assert retried == 0
    servers = [first]

    def restart() -> None:
        servers[0].close()
        servers[0] = serve_on(tmp_path / "b", port=port)

    try:
        with StepClient(first.base) as client:
            got, retried = sample(client, 12, restart_at=6, restart=restart)
        assert retried == 1  # one 409 `missing` (cond and table), answered by re-uploading
        assert np.array_equal(got, reference)
    finally:
        servers[0].close()


# ---------------------------------------------------------------- interrupt storm


def test_an_interrupt_storm_hits_only_the_runs_it_names(fresh):
    cond = np.ones((1, 3, 8), np.float32)
    digest = digest_of(cond)
    x0 = np.full((1, 4, 4, 4), 0.1, np.float32)

    def steps(client: StepClient, run: str, count: int):
        x, outcome = x0, "finished"
        for i in range(count):
            try:
                answer = client.step(x, [i / count], [{"cond": digest}], run=run)
            except StepError as error:
                assert error.status == 409 and error.code == "interrupted", error
                outcome = "interrupted"
                for _ in range(3):  # and every later step of that run
                    with pytest.raises(StepError) as again:
                        client.step(x, [0.0], [{"cond": digest}], run=run)
                    assert again.value.code == "interrupted"
                break
            x = x - np.float32(0.1) * answer.out
        assert client.end_run(run)
        with pytest.raises(StepError) as gone:
            client.step(x, [0.0], [{"cond": digest}], run=run)
        assert gone.value.status == 404
        return outcome, x

    clients = [StepClient(fresh.base) for _ in range(8)]
    clients[0].put_tensor(cond)
    runs = [c.begin_run("alpha") for c in clients]
    victims = runs[:4]
    with StepClient(fresh.base) as alone:
        reference = steps(alone, alone.begin_run("alpha"), 60)
    stop = threading.Event()
    fired: list[tuple[str | None, int]] = []

    def storm(seed: int) -> None:
        chooser = random.Random(seed)
        with StepClient(fresh.base) as client:
            while not stop.is_set():
                target = chooser.choice([*victims, "f" * 16, None, "not-a-run"])
                fired.append((target, client.interrupt(target)))

    storms = [threading.Thread(target=storm, args=(seed,)) for seed in range(2)]
    for thread in storms:
        thread.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(
                pool.map(lambda cr: steps(cr[0], cr[1], 60), zip(clients, runs, strict=True))
            )
    finally:
        stop.set()
        for thread in storms:
            thread.join()
        for client in clients:
            client.close()
    assert [o for o, _ in outcomes[:4]] == ["interrupted"] * 4
    for outcome, x in outcomes[4:]:
        assert outcome == "finished" and np.array_equal(x, reference[1])
    hits = [count for target, count in fired if target in victims]
    assert sum(hits) >= 4 and len(fired) > len(hits)  # every victim hit; others fired too
    assert all(count == 0 for target, count in fired if target not in victims)
    assert fresh.ctx.service.run_count() == 0
    a_step_works(fresh)


# ---------------------------------------------------------------- slow clients


def test_slow_clients_hold_no_thread_and_are_closed_after_the_channel_timeout(tmp_path):
    """Waitress reads every connection on its one event loop and gives a request a thread only
    once it is complete, so clients that stall mid-head or mid-body hold no thread; after
    `channel_timeout` of silence the server closes them."""
    server = serve_on(tmp_path, channel_timeout=2, cleanup_interval=1)
    try:
        slow = []
        for i in range(20):  # more stalled clients than the 8 threads
            sock = socket.create_connection(address(server))
            part = b"POST /internal/image-steps/v1/step HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            if i % 2:
                part += b"Content-Length: 1000\r\n\r\n" + b"\0" * 10  # stalls mid-body
            sock.sendall(part)
            slow.append(sock)
        started = time.perf_counter()
        a_step_works(server)
        assert time.perf_counter() - started < 5
        for sock in slow:
            sock.settimeout(10)
            assert sock.recv(1) == b""  # closed by the server, unanswered
            sock.close()
        assert wait_for(lambda: open_channels(server) == 0)
        a_step_works(server)
    finally:
        server.close()


def test_the_served_channel_timeout_is_deliberate():
    options = waitress_options(ServerConfig())
    assert options["channel_timeout"] >= 60  # a 1 GiB body over a slow link still arrives
    assert options["threads"] >= 2


# ---------------------------------------------------------------- unload during a run


def test_unload_during_a_run_is_busy_and_the_run_goes_on(fresh):
    cond = np.ones((1, 2, 8), np.float32)
    with StepClient(fresh.base) as client:
        digest = client.put_tensor(cond)
        run = client.begin_run("alpha")
        for _ in range(3):
            r = fresh.post_json("models/unload", {"model": "alpha"})
            assert r.status_code == 409
            assert r.json()["code"] == "busy" and r.json()["in_flight"] == 1
            client.step(np.ones((1, 4, 2, 2), np.float32), [0.5], [{"cond": digest}], run=run)
        assert fresh.ctx.registry.loaded("alpha") is not None
        assert client.end_run(run)
    r = fresh.post_json("models/unload", {"model": "alpha"})
    assert r.status_code == 200 and r.json() == {"model": "alpha", "unloaded": True}


def test_unload_behind_a_step_in_flight(fresh):
    """A step without a run holds the model while it computes. An unload queues behind it on
    the image worker; whether the step's hold is released by then is a race, so the answer is
    409 busy (model kept) or 200 (model let go); either way the step's answer is right and the
    model serves the next step."""
    cond = np.ones((1, 2, 8), np.float32)
    x = np.ones((1, 4, 2, 2), np.float32)
    with StepClient(fresh.base) as client:
        digest = client.put_tensor(cond)
        client.step(x, [0.5], [{"cond": digest}])
    model = fresh.model()
    model.hold_steps()
    with ThreadPoolExecutor(2) as pool:
        step = pool.submit(lambda: StepClient(fresh.base).step(x, [0.5], [{"cond": digest}]))
        assert model.step_started.wait(10)
        unload = pool.submit(lambda: fresh.post_json("models/unload", {"model": "alpha"}))
        time.sleep(0.2)
        assert not unload.done()  # queued behind the step on the worker
        model.release_steps()
        assert np.array_equal(step.result().out[0], linear_family.row_output(x[0], 0.5, cond[0]))
        answer = unload.result()
    if answer.status_code == 409:
        assert answer.json()["code"] == "busy" and answer.json()["in_flight"] == 1
        assert not model.closed
    else:
        assert answer.json() == {"model": "alpha", "unloaded": True} and model.closed
    a_step_works(fresh)
