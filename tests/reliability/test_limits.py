"""Body limits and the disk: an oversized body is refused 413 from its request head, before any
byte of it is read; a client still sending gets to read that 413; Waitress' own refusals are
JSON; and nothing a request carries is written to disk (no temporary-file spooling).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import numpy as np
import pytest
import requests
from gmlx_contract import wire
from gmlx_contract.hashing import tensor_hash
from gmlx_server.app import BUFFER_BYTES, waitress_options
from gmlx_server.config import ServerConfig

from ..server.conftest import CONTAINER, VERSION

STEPS = "/internal/image-steps/v1"


def address(server) -> tuple[str, int]:
    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def head_only(server, path: str, content_type: str, length: int, extra: str = "") -> bytes:
    """Send a request head announcing `length` body bytes, send no body, read the answer."""
    with socket.create_connection(address(server), timeout=10) as sock:
        sock.sendall(
            (
                f"POST {STEPS}/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: {content_type}\r\nX-Gmlx-Steps-Contract: 1.0\r\n"
                f"Content-Length: {length}\r\n{extra}\r\n"
            ).encode()
        )
        return read_answer(sock)


def read_answer(sock: socket.socket) -> bytes:
    answer = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        answer += chunk
    return answer


def nested_413(answer: bytes) -> str:
    """The message of a 413 in the contract's nested error form."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"Content-Type: application/json" in head
    import json

    error = json.loads(body)["error"]
    assert error["type"] == "request_too_large" and "over the limit" in error["message"]
    return error["message"]


@pytest.mark.parametrize(
    "path, content_type, limit",
    [
        ("interrupt", "application/json", wire.MAX_JSON_BYTES),
        ("runs/begin", "text/plain", wire.MAX_JSON_BYTES),
        ("step", wire.CONTAINER_TYPE, wire.MAX_CONTAINER_BYTES),
        ("tensors/" + "0" * 64, wire.CONTAINER_TYPE, wire.MAX_CONTAINER_BYTES),
    ],
)
def test_an_oversized_body_is_refused_from_its_head(live, path, content_type, limit):
    started = time.perf_counter()
    nested_413(head_only(live, path, content_type, limit + 1))
    assert time.perf_counter() - started < 5  # answered without waiting for a body


def test_a_length_past_every_limit_is_refused_naming_its_routes_limit(live):
    """A Content-Length past Waitress' own bound too (its buffer): the route's limit is named,
    as for any other oversized body, not Waitress' bound."""
    said = nested_413(head_only(live, "interrupt", "application/json", 99_999_999_999))
    assert (
        said
        == f"request body of 99999999999 bytes is over the limit of {wire.MAX_JSON_BYTES} bytes"
    )


def logged(caplog, prefix: str) -> list[str]:
    """The server's log lines that start with `prefix` (waiting a moment for the HTTP thread)."""
    deadline = time.monotonic() + 2.0
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "gmlx.server"]
        found = [line for line in lines if line.startswith(prefix)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_refusals_made_before_the_app_are_logged(live, caplog):
    """Waitress refuses an oversized body from its head (the app never sees the request) and a
    chunked one as it passes the limit; both get the request log line every answer gets."""
    caplog.set_level("INFO", logger="gmlx.server")
    nested_413(head_only(live, "interrupt", "application/json", wire.MAX_JSON_BYTES + 1))
    assert logged(caplog, f"POST {STEPS}/interrupt 413 ")

    def chunks():
        for _ in range(wire.MAX_JSON_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)

    caplog.clear()
    r = requests.post(live.url + "/runs/begin", data=chunks(), headers=VERSION, timeout=60)
    assert r.status_code == 413
    assert logged(caplog, f"POST {STEPS}/runs/begin 413 ")


def test_expect_continue_over_the_limit_gets_413_not_100(live):
    answer = head_only(
        live, "interrupt", "application/json", wire.MAX_JSON_BYTES + 1, "Expect: 100-continue\r\n"
    )
    assert b"100 Continue" not in answer
    nested_413(answer)


def test_a_client_still_sending_reads_the_413(live):
    """requests sends its whole body before reading: the lingering close lets it read the 413
    instead of a connection reset."""
    body = b" " * (wire.MAX_JSON_BYTES + 1)
    for _ in range(3):
        r = requests.post(
            live.url + "/interrupt",
            data=body,
            headers={**VERSION, "Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert live.call("POST", "interrupt").status_code == 200


def test_a_chunked_body_is_refused_once_it_passes_the_limit(live):
    def chunks():
        for _ in range(wire.MAX_JSON_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)

    r = requests.post(
        live.url + "/interrupt",
        data=chunks(),
        headers={**VERSION, "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413
    assert "chunked" in r.json()["error"]["message"]


def test_a_body_of_exactly_the_limit_is_served(live):
    r = live.call(
        "POST",
        "interrupt",
        data=b" " * wire.MAX_JSON_BYTES,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 200 and r.json() == {"interrupted": 0}


@pytest.mark.parametrize(
    "request_head",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ten\r\n\r\n",
        b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 300_000 + b"\r\n\r\n",
    ],
)
def test_waitress_refusals_are_json(live, request_head):
    with socket.create_connection(address(live), timeout=10) as sock:
        sock.sendall(request_head)
        answer = read_answer(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert 400 <= status < 500 or status == 501, head
    import json

    assert set(json.loads(body)["error"]) == {"type", "message"}


# ---------------------------------------------------------------- nothing on disk


def test_no_body_the_gate_admits_can_spill_to_a_file():
    """Waitress moves a buffer to a temporary file once it reaches `inbuf_overflow`: that must
    be above the largest body the gate admits plus one read."""
    options = waitress_options(ServerConfig())
    assert options["inbuf_overflow"] > wire.MAX_CONTAINER_BYTES + options["recv_bytes"]
    assert options["outbuf_overflow"] >= BUFFER_BYTES
    # the largest answer: a VAE decode of 16 RGBA images of 2048x2048 in float32
    assert options["outbuf_overflow"] > 16 * wire.MAX_PIXELS * 4 * 4 + (1 << 20)


class WriteWatch:
    """Every file a server thread opens for writing, seen through Python's audit hooks (which
    cover open(), os.open and so tempfile)."""

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def __init__(self) -> None:
        self.active = False
        self.seen: list[tuple[str, str]] = []
        self.threads: set[str] = set()
        sys.addaudithook(self._hook)  # hooks cannot be removed: `active` gates it

    def _hook(self, event: str, args) -> None:
        if not self.active or event != "open":
            return
        thread = threading.current_thread()
        if thread is self.main:
            return
        path, mode, flags = args
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & self.WRITE_FLAGS
        )
        if writes:
            self.seen.append((thread.name, str(path)))

    def __enter__(self) -> WriteWatch:
        self.main = threading.current_thread()
        self.seen.clear()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False


WATCH = WriteWatch()


def test_requests_write_nothing_to_disk(fresh, monkeypatch):
    """Uploads, a step, encodes, VAE passes, a 100 MiB body (over the 96 MiB that used to
    spill) and an oversized one: no server thread opens a file for writing, and Waitress never
    makes a temporary-file buffer."""
    from waitress import buffers

    spilled: list[int] = []
    original = buffers.TempfileBasedBuffer.__init__

    def spy(self, *args, **kw):
        spilled.append(1)
        original(self, *args, **kw)

    monkeypatch.setattr(buffers.TempfileBasedBuffer, "__init__", spy)
    big = np.zeros((100 << 20) // 4, np.float32)
    with WATCH:
        cond = fresh.put_tensor(np.ones((1, 3, 8), np.float32))
        r = fresh.post_container(
            "step",
            {"x": np.ones((2, 4, 8, 8), np.float32), "timestep": np.ones(2, np.float32)},
            {"rows": [{"cond": cond}, {"cond": cond}]},
        )
        assert r.status_code == 200
        assert fresh.post_json("encode", {"text": "a cat"}).status_code == 200
        image = np.zeros((1, 16, 16, 3), np.float32)
        assert fresh.post_container("vae/encode", {"image": image}).status_code == 200
        latents = np.zeros((1, 4, 4, 4), np.float32)
        assert fresh.post_container("vae/decode", {"latents": latents}).status_code == 200
        r = fresh.call(
            "PUT",
            f"tensors/{tensor_hash(big)}",
            data=wire.write_container({"t": big}),
            headers=CONTAINER,
        )
        assert r.status_code == 413  # over the 64 MiB tensor bound, but read whole
        nested_413(head_only(fresh, "step", wire.CONTAINER_TYPE, wire.MAX_CONTAINER_BYTES + 1))
    assert WATCH.seen == []
    assert spilled == []


def test_the_write_watch_sees_a_temporary_file():
    """The watch itself works: a temporary file made on another thread is seen."""
    import tempfile

    def make() -> None:
        with tempfile.TemporaryFile():
            pass

    with WATCH:
        thread = threading.Thread(target=make, name="probe")
        thread.start()
        thread.join()
    assert {name for name, _ in WATCH.seen} == {"probe"}
