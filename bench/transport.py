"""Where the time of a step request goes, against the floor of moving the same bytes.

One 1024x1024 guided step moves x (2, 64, 64, 64) float32 = 2 MiB to the server and `out` of the
same size back. This script measures, in one process and one run:

  floor      the same bytes both ways over one keep-alive loopback TCP socket (length-prefixed,
             recv_into a buffer allocated once), which no HTTP stack can beat; back to back,
             and (with --idle-ms) each round trip after that long asleep, as a step's transport
             comes after a forward (threads and CPUs that slept wake slower, caches have cooled);
  layers     a Falcon app on Waitress whose step route only parses the container and answers a
             copy of x (X-Gmlx-Forward-Ms 0), under Waitress' default settings, under the
             settings the server uses, and with the server's own channel too (http_gate), driven
             by plain `requests`, by `requests` with one raw read, by `http.client`, and by the
             shared StepClient;
  route      (with --route) the real step route of the server's app on the embedded default model,
             driven by StepClient exactly as `gmlx image bench --via-steps` does: transport is the
             client's wall time less the X-Gmlx-Forward-Ms the server reports.

    .venv/bin/python bench/transport.py [--size 1024] [--rows 2] [--count 200] [--idle-ms 650]
                                        [--route] [--json]

The route runs the model's forward once per request (seconds at 1024x1024 on a 2-core CPU), so
it takes its own, smaller count (--route-count).

Results go to docs/benchmarks.md ("Sampling and transport").
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import falcon
import numpy as np
import requests
from gmlx_contract import wire
from gmlx_contract.client import StepClient
from gmlx_contract.version import CONTRACT_VERSION, HEADER
from gmlx_server.app import ServerThread, waitress_options, whole_body
from gmlx_server.config import ServerConfig
from gmlx_server.http_gate import gated_server
from gmlx_server.process import fast_blas, tune_malloc
from gmlx_server.routes.common import send_container
from waitress.server import create_server

STEP_PATH = "/internal/image-steps/v1/step"
VERSION_VALUE = f"{CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]}"

# Waitress as the library ships it, for comparison with the settings the server runs.
WAITRESS_DEFAULTS: dict = {}


# ---------------------------------------------------------------- the floor


def raw_floor_ms(nbytes: int, count: int, warmup: int = 10, idle_s: float = 0.0) -> list[float]:
    """Round trips of `nbytes` each way over one loopback socket, in ms; with `idle_s`, each
    after that long asleep (as a step's transport comes after the forward)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    thread = threading.Thread(target=_echo_socket, args=(listener, nbytes), daemon=True)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = nbytes.to_bytes(8, "little") + bytes(nbytes)
    reply = bytearray(nbytes)
    times = []
    try:
        for i in range(warmup + count):
            if idle_s and i >= warmup:
                time.sleep(idle_s)
            start = time.perf_counter()
            client.sendall(request)
            _recv_exactly(client, memoryview(reply))
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1000)
    finally:
        client.close()
        listener.close()
    return times


def _echo_socket(listener: socket.socket, nbytes: int) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = bytearray(nbytes)
    length = bytearray(8)
    answer = bytes(nbytes)
    with conn:
        while True:
            if not _recv_exactly(conn, memoryview(length)):
                return
            _recv_exactly(conn, memoryview(body)[: int.from_bytes(length, "little")])
            conn.sendall(answer)


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


# ---------------------------------------------------------------- the HTTP layers


class EchoStep:
    """A step route without a model: parse the container, answer a float32 copy of x. The body
    is taken and the answer given the way the server's gate and routes do it."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = whole_body(req)
        if body is None:
            body = req.bounded_stream.read(req.content_length or 0)
        x = wire.read_container(body).tensors["x"]
        out = np.array(x, dtype=np.float32)  # a model's output is a new array
        send_container(resp, wire.container_pieces({"out": out}))
        resp.set_header("X-Gmlx-Forward-Ms", "0.00")


def echo_app() -> falcon.App:
    app = falcon.App()
    app.add_route(STEP_PATH, EchoStep())
    return app


def step_body(x: np.ndarray) -> bytes:
    rows = [{"cond": "0" * 64, "num_tokens": 1} for _ in range(len(x))]
    timestep = np.ones(len(x), dtype=np.float32)
    return wire.write_container({"x": x, "timestep": timestep}, {"rows": rows})


def time_requests_plain(base: str, body: bytes, count: int) -> list[float]:
    session = requests.Session()
    headers = {"Content-Type": wire.CONTAINER_TYPE, HEADER: VERSION_VALUE}
    return _timed(count, lambda: session.post(base + STEP_PATH, data=body, headers=headers).content)


def time_requests_one_read(base: str, body: bytes, count: int) -> list[float]:
    session = requests.Session()
    headers = {"Content-Type": wire.CONTAINER_TYPE, HEADER: VERSION_VALUE}

    def call():
        resp = session.post(base + STEP_PATH, data=body, headers=headers, stream=True)
        data = resp.raw.read(decode_content=False)
        resp.close()
        return data

    return _timed(count, call)


def time_http_client(base: str, body: bytes, count: int) -> list[float]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    headers = {"Content-Type": wire.CONTAINER_TYPE, HEADER: VERSION_VALUE}

    def call():
        conn.request("POST", STEP_PATH, body=body, headers=headers)
        return conn.getresponse().read()

    try:
        return _timed(count, call)
    finally:
        conn.close()


def time_step_client(base: str, x: np.ndarray, count: int) -> list[float]:
    """StepClient.step against the echo route: its wall time less the reported 0 ms forward."""
    client = StepClient(base)
    rows = [{"cond": "0" * 64, "num_tokens": 1} for _ in range(len(x))]
    timestep = np.ones(len(x), dtype=np.float32)
    times = []
    for i in range(count + 10):
        answer = client.step(x, timestep, rows, convention="reference")
        if i >= 10:
            times.append(answer.wall_ms - answer.forward_ms)
    return times


def _timed(count: int, call, warmup: int = 10) -> list[float]:
    times = []
    for i in range(warmup + count):
        start = time.perf_counter()
        call()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1000)
    return times


@contextmanager
def plain_waitress(app, settings: dict, gated: bool = False) -> Iterator[str]:
    """The app on Waitress as configured, on an ephemeral 127.0.0.1 port; yields the base URL.
    `gated`: with the server's own channel (http_gate: tensor bodies received in place)."""
    make = gated_server if gated else create_server
    thread = ServerThread(make(app, host="127.0.0.1", port=0, **settings)).start()
    try:
        yield f"http://127.0.0.1:{thread.port}"
    finally:
        thread.stop()


def measure_layers(x: np.ndarray, count: int) -> dict:
    body = step_body(x)
    results = {}
    server_settings = waitress_options(ServerConfig())
    for settings_name, settings, gated in (
        ("waitress defaults", WAITRESS_DEFAULTS, False),
        ("server settings", server_settings, False),
        ("server settings and channel", server_settings, True),
    ):
        with plain_waitress(echo_app(), settings, gated) as base:
            results[f"{settings_name} / requests"] = time_requests_plain(base, body, count)
            results[f"{settings_name} / requests, one raw read"] = time_requests_one_read(
                base, body, count
            )
            results[f"{settings_name} / http.client"] = time_http_client(base, body, count)
            results[f"{settings_name} / StepClient"] = time_step_client(base, x, count)
    return results


# ---------------------------------------------------------------- the real route


def measure_route(
    width: int, height: int, rows: int, count: int, warmup: int = 5
) -> tuple[list[float], list[float]]:
    """Transport per step of the real step route on the embedded default model (or the
    configured default), as `gmlx image bench --via-steps` drives it: (wall - forward, and the
    part of it spent in the route on the server: X-Gmlx-Server-Ms - forward)."""
    from gmlx_server.model_choice import choose_model
    from gmlx_server.step_server import StepServer, ViaStepsTransport

    choice = choose_model(None)
    with StepServer(choice) as server, StepClient(server.base_url) as client:
        latent = server.load().model.status()["latent"]
        via = ViaStepsTransport(client, server.direct(), choice.model_id)
        prompts = ["a lighthouse on a cliff at dusk", ""][:rows]
        step_rows = [via.row(via.encode(text, ())) for text in prompts]
        shape = (1, latent["channels"], height // latent["stride"], width // latent["stride"])
        x = np.concatenate([np.random.default_rng(0).standard_normal(shape, np.float32)] * rows)
        timestep = np.full(rows, 0.5, dtype=np.float32)
        via.begin(np.array([1.0, 0.5, 0.0], np.float32))  # the run's schedule, its step in it
        try:
            for _ in range(warmup + count):
                via.step(x, timestep, step_rows)
        finally:
            via.end()
        return via.transport_ms[warmup:], via.server_ms[warmup:]


# ---------------------------------------------------------------- report


def summarise(times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p10_ms": round(ordered[len(ordered) // 10], 3),
        "p90_ms": round(ordered[(len(ordered) * 9) // 10], 3),
        "count": len(ordered),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--rows", type=int, default=2, help="rows per step (2 = guided)")
    parser.add_argument("--count", type=int, default=200, help="timed requests per measurement")
    parser.add_argument("--route", action="store_true", help="also time the real step route")
    parser.add_argument("--route-count", type=int, default=20, help="timed steps of the route")
    parser.add_argument(
        "--idle-ms", type=float, default=0.0, help="also time the floor after this long idle"
    )
    parser.add_argument("--idle-count", type=int, default=15, help="round trips after idle")
    parser.add_argument("--no-tune", action="store_true", help="leave the allocator as it is")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    if not args.no_tune:
        tune_malloc()  # what gmlx serve does first
    fast_blas()  # before mlx is imported (the route's model)
    side = args.size // 16
    x = np.random.default_rng(0).standard_normal((args.rows, 64, side, side), dtype=np.float32)
    nbytes = len(step_body(x))
    report = {
        "load_1min_start": round(os.getloadavg()[0], 2),
        "size": args.size,
        "rows": args.rows,
        "bytes_each_way": x.nbytes,
        "request_bytes": nbytes,
        "allocator_tuned": not args.no_tune,
        "floor": summarise(raw_floor_ms(nbytes, args.count)),
        "layers": {k: summarise(v) for k, v in measure_layers(x, args.count).items()},
    }
    if args.idle_ms:
        idle = raw_floor_ms(nbytes, args.idle_count, idle_s=args.idle_ms / 1000.0)
        report["floor_after_idle"] = {"idle_ms": args.idle_ms, **summarise(idle)}
    if args.route:
        transport, in_route = measure_route(args.size, args.size, args.rows, args.route_count)
        report["route"] = summarise(transport)
        report["route_server_part"] = summarise(in_route)
        report["floor_after_route"] = summarise(raw_floor_ms(nbytes, args.count))
    report["load_1min_end"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.size}x{args.size}, {args.rows} rows: {x.nbytes / 2**20:.2f} MiB each way")
    print(f"{'floor (raw loopback socket)':<52} {report['floor']['median_ms']:8.3f} ms")
    if "floor_after_idle" in report:
        name = f"floor, each after {args.idle_ms:.0f} ms idle"
        print(f"{name:<52} {report['floor_after_idle']['median_ms']:8.3f} ms")
    for name, summary in report["layers"].items():
        print(f"{name:<52} {summary['median_ms']:8.3f} ms")
    if "route" in report:
        print(
            f"{'step route (wall - forward), StepClient':<52} {report['route']['median_ms']:8.3f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
