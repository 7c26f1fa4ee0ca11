"""Load: concurrent clients get exactly what they get alone; the run limit holds under a burst;
caches and resident memory stay flat over thousands of steps.

Figures (steps, seconds, RSS) are printed as `FIGURE ...` lines; `pytest -m heavy -s` shows
them, and docs/reliability.md records a run.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.client import StepClient, digest_of
from gmlx_contract.errors import StepError
from gmlx_server.config import ServerConfig
from gmlx_server.engine.registry import ModelRegistry

from ..server.conftest import serve, start_server
from ..server.linear_family import WIDTH

CLIENTS = 8


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def figure(text: str) -> None:
    print(f"FIGURE {text}", flush=True)


# ---------------------------------------------------------------- a client's sampling


def sample(base: str, seed: int, steps: int, model: str | None, shape, cond_width: int):
    """A small Euler-like loop through the shared client: returns (final x, digest of every
    output), which depend only on the seed, never on other clients."""
    rng = np.random.default_rng(seed)
    cond = rng.standard_normal((1, 3 + seed % 4, cond_width)).astype(np.float32)
    digest = digest_of(cond)
    x = rng.standard_normal(shape).astype(np.float32)
    outputs = hashlib.sha256()
    rows = [{"cond": digest}, {"cond": digest, "num_tokens": 2}][: shape[0]]
    with StepClient(base) as client:
        run = client.begin_run(model)
        for i in range(steps):
            t = np.full(shape[0], 1.0 - i / steps, np.float32)
            answer = client.step(x, t, rows, run=run, uploads={digest: cond})
            outputs.update(answer.out.tobytes())
            x = (x - np.float32(0.02) * answer.out).astype(np.float32)
        assert client.end_run(run)
    return x, outputs.hexdigest()


def alone_then_together(base: str, steps: int, model=None, shape=(2, 4, 4, 4), width=8):
    seeds = list(range(CLIENTS))
    alone = [sample(base, s, steps, model, shape, width) for s in seeds]
    started = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        together = list(pool.map(lambda s: sample(base, s, steps, model, shape, width), seeds))
    seconds = time.perf_counter() - started
    for seed, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert a[1] == b[1], f"client {seed}: outputs differ under load"
        assert np.array_equal(a[0], b[0])
    assert len({digest for _, digest in alone}) == CLIENTS  # the clients really differ
    return seconds


def test_eight_clients_equal_their_single_client_results(fresh):
    seconds = alone_then_together(fresh.base, steps=40)
    figure(f"load linear: {CLIENTS} clients x 40 steps together in {seconds:.2f} s")
    assert fresh.ctx.service.run_count() == 0


@pytest.mark.heavy
def test_eight_clients_long_run(fresh):
    seconds = alone_then_together(fresh.base, steps=300)
    figure(f"load linear: {CLIENTS} clients x 300 steps together in {seconds:.2f} s")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    embedded = pytest.importorskip("gmlx_server.engine.families.qwen_image21.embedded")
    folder = embedded.ensure_embedded_model(tmp_path_factory.mktemp("embedded"))
    registry = ModelRegistry([], folder.name, extra_models=[folder])
    server = serve(ServerConfig(host="127.0.0.1", port=0), registry)
    server.model_id = folder.name
    yield server
    server.close()


def qwen_width(server) -> int:
    """The conditioning width of the embedded model (its text encoder's hidden size)."""
    reply = server.post_json("encode", {"text": "a"})
    assert reply.status_code == 200, reply.text
    return int(wire.read_container(reply.content).tensors["cond"].shape[-1])


def test_eight_clients_on_the_embedded_real_model(qwen):
    width = qwen_width(qwen)
    seconds = alone_then_together(qwen.base, 3, qwen.model_id, (2, 64, 2, 2), width)
    figure(f"load qwen embedded: {CLIENTS} clients x 3 steps (2 rows, 32x32) in {seconds:.2f} s")


@pytest.mark.heavy
def test_eight_clients_on_the_embedded_real_model_long(qwen):
    width = qwen_width(qwen)
    seconds = alone_then_together(qwen.base, 25, qwen.model_id, (2, 64, 4, 4), width)
    figure(f"load qwen embedded: {CLIENTS} clients x 25 steps (2 rows, 64x64) in {seconds:.2f} s")


# ---------------------------------------------------------------- the run limit


def test_a_burst_of_begins_gets_exactly_32_runs(fresh):
    barrier = threading.Barrier(40)

    def begin(_):
        with StepClient(fresh.base) as client:
            barrier.wait()
            try:
                return client.begin_run("alpha")
            except StepError as error:
                return error.status

    with ThreadPoolExecutor(40) as pool:
        results = list(pool.map(begin, range(40)))
    runs = [r for r in results if isinstance(r, str)]
    assert len(runs) == wire.MAX_RUNS and results.count(429) == 40 - wire.MAX_RUNS
    loaded = fresh.ctx.registry.loaded("alpha")
    assert loaded.holds == wire.MAX_RUNS  # the refused begins hold nothing
    with StepClient(fresh.base) as client:
        with pytest.raises(StepError) as refused:
            client.begin_run("alpha")
        assert refused.value.status == 429
        assert all(client.end_run(run) for run in runs)
        assert loaded.holds == 0
        client.end_run(client.begin_run("alpha"))  # and a slot is free again


# ---------------------------------------------------------------- memory over many steps


def steady_state(server, steps: int, fresh_tensor_every: int = 4):
    """Steps in one run, a new conditioning uploaded every few steps (so the tensor cache keeps
    evicting): RSS after warm-up and at the end, and the cache figures."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 4, 16, 16)).astype(np.float32)
    t = np.array([0.5, 0.25], np.float32)
    service = server.ctx.service
    with StepClient(server.base) as client:
        run = client.begin_run("alpha")
        warm, peak = None, 0.0
        started = time.perf_counter()
        for i in range(steps):
            if i % fresh_tensor_every == 0:
                cond = rng.standard_normal((1, 32768 // WIDTH, WIDTH)).astype(np.float32)  # 256 KiB
                digest = digest_of(cond)
            answer = client.step(x, t, [{"cond": digest}] * 2, run=run, uploads={digest: cond})
            assert answer.out.shape == x.shape
            if i == steps // 5:
                warm = rss_mib()
            if i >= steps // 5:
                peak = max(peak, rss_mib())
                assert service.tensors.total <= service.tensors.bound
        seconds = time.perf_counter() - started
        client.end_run(run)
    end = rss_mib()
    return warm, peak, end, seconds, len(service.tensors), service.tensors.total


@pytest.mark.parametrize("steps", [1200, pytest.param(6000, marks=pytest.mark.heavy)])
def test_memory_is_flat_over_many_steps(server_factory, steps):
    server = server_factory(tensor_cache_mb=4)
    warm, peak, end, seconds, entries, total = steady_state(server, steps)
    figure(
        f"steady state: {steps} steps in {seconds:.1f} s, {steps // 4} conditionings of "
        f"256 KiB through a 4 MiB cache ({entries} held, {total} bytes); RSS after warm-up "
        f"{warm:.1f} MiB, peak {peak:.1f} MiB, end {end:.1f} MiB"
    )
    assert peak - warm < 32, f"RSS grew from {warm:.1f} to {peak:.1f} MiB"
    assert server.ctx.service.run_count() == 0


def test_start_server_reuse_is_clean(tmp_path):
    """Many servers started and closed in one process leave no worker or sweeper behind."""
    before = {t.name for t in threading.enumerate()}
    for i in range(5):
        start_server(tmp_path / f"s{i}").close()
    time.sleep(0.2)
    after = [t.name for t in threading.enumerate() if t.name not in before]
    prefixes = ("gmlx-image", "gmlx-sweeper", "gmlx-http", "waitress-")
    assert not [n for n in after if n.startswith(prefixes)]


# ---------------------------------------------------------------- a soak with LoRA tables changing


def lora_soak(steps: int, tables: int) -> tuple[float, float, float, float]:
    """`steps` steps of the embedded Z-Image in one run, cycling through `tables` LoRA patch
    tables of their own adapters (a table change every 10 steps, its pairs built anew each
    time it comes back): RSS after warm-up, at its peak and at the end, and the seconds."""
    from gmlx_server.engine.families.z_image import embedded

    from ..lora.over_http import lora_table, put_table

    folder = embedded.ensure_embedded_model(Path(tempfile.mkdtemp()) / "cache")
    registry = ModelRegistry([], folder.name, extra_models=[folder])
    server = serve(ServerConfig(host="127.0.0.1", port=0), registry)
    try:
        encoded = server.post_json("encode", {"text": "a lighthouse"})
        cond = wire.read_container(encoded.content).fields["cond"]
        manifest = server.call("GET", f"models/{folder.name}/manifest").json()["tensors"]
        shapes = {t["name"][: -len(".weight")]: tuple(t["shape"]) for t in manifest}
        layers = [n for n in shapes if n.endswith(".attention.to_q")][:2]
        ids = []
        for seed in range(tables):
            entries, adapters, _ = lora_table(shapes, dict.fromkeys(layers), seed, 0.5)
            reply, table = put_table(server, folder.name, entries, adapters)
            assert reply.status_code == 200, reply.text
            ids.append(table)
        x = np.random.default_rng(3).standard_normal((1, 16, 8, 8)).astype(np.float32)
        with StepClient(server.base) as client:
            run = client.begin_run(folder.name)
            warm, peak = None, 0.0
            started = time.perf_counter()
            for i in range(steps):
                table = ids[(i // 10) % tables]
                answer = client.step(x, [0.5], [{"cond": cond}], run=run, patch_table=table)
                assert answer.out.shape == x.shape
                if i == steps // 5:
                    warm = rss_mib()
                if i >= steps // 5:
                    peak = max(peak, rss_mib())
            seconds = time.perf_counter() - started
            client.end_run(run)
        return warm, peak, rss_mib(), seconds
    finally:
        server.close()


@pytest.mark.heavy
def test_a_soak_of_ten_thousand_steps_with_tables_changing_keeps_rss_flat():
    warm, peak, end, seconds = lora_soak(10_000, tables=8)
    figure(
        f"LoRA soak: 10,000 steps of the embedded Z-Image in {seconds:.0f} s, 8 patch tables"
        f" changing every 10 steps; RSS after warm-up {warm:.1f} MiB, peak {peak:.1f} MiB,"
        f" end {end:.1f} MiB ({(peak - warm) / warm:+.2%})"
    )
    assert peak <= warm * 1.02, f"RSS grew from {warm:.1f} to {peak:.1f} MiB"


def test_a_short_soak_with_tables_changing():
    warm, peak, _, _ = lora_soak(300, tables=4)
    assert peak - warm < 32
