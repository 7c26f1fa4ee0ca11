"""The step bodies' copy-free paths: the gate takes Waitress' request buffer as it is, and
container answers leave as a stream over the tensors themselves (no join, no copy into
Waitress' buffer)."""

from __future__ import annotations

import io
import socket
import time

import falcon
import falcon.testing
import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.hashing import tensor_hash
from gmlx_server import http_gate
from gmlx_server.app import whole_body
from gmlx_server.http_gate import IN_PLACE_MIN_BYTES, GatedChannel
from gmlx_server.routes.common import PREFIX, PiecesReader, send_container


def request(body: bytes, **env) -> falcon.Request:
    return falcon.Request(falcon.testing.create_environ(method="POST", body=body, **env))


def test_whole_body_is_the_buffer_itself():
    body = bytes(range(256)) * 64
    req = request(b"")
    req.env["wsgi.input"] = stream = io.BytesIO(body)
    req.env["CONTENT_LENGTH"] = str(len(body))
    got = whole_body(falcon.Request(req.env))
    assert got is body  # no copy
    assert stream.read() == b""  # consumed, as a read would leave it


def test_whole_body_falls_back_when_it_cannot_be_sure():
    assert whole_body(request(b"abc", headers={"Content-Length": "2"})) is None
    req = request(b"abc")
    req.env["wsgi.input"].read(1)
    assert whole_body(req) is None  # someone read already
    req = request(b"abc")
    del req.env["CONTENT_LENGTH"]
    assert whole_body(falcon.Request(req.env)) is None  # no length: read it the slow way
    assert whole_body(request(b"abc")) == b"abc"


def test_container_answer_is_a_stream_over_the_tensors_own_memory():
    out = np.arange(6, dtype=np.float32)
    body = wire.write_container({"out": out}, {"note": "x"})
    resp = falcon.Response()
    send_container(resp, wire.container_pieces({"out": out}, {"note": "x"}))
    assert resp.data is None and int(resp.content_length) == len(body)
    assert resp.content_type == wire.CONTAINER_TYPE
    stream = resp.stream
    head = stream.read(1 << 20)  # a read never crosses a piece's end
    assert bytes(head) == body[: len(body) - out.nbytes]
    tensor = stream.read(1 << 20)
    assert np.shares_memory(np.frombuffer(tensor, dtype=np.float32), out)  # no copy
    assert bytes(tensor) == out.tobytes() and stream.read(1) == b""


def test_pieces_reader_seeks_as_waitress_file_wrapper_does():
    pieces = [b"abc", memoryview(b"defgh"), b"", b"ij"]
    stream = PiecesReader(pieces)
    assert stream.size == 10 and stream.seekable()
    assert stream.seek(0, io.SEEK_END) == 10 and stream.seek(2) == 2
    assert bytes(stream.read(4)) == b"c"  # to the end of the first piece
    assert stream.tell() == 3 and stream.seek(-1, io.SEEK_CUR) == 2
    stream.seek(4, io.SEEK_CUR)  # Waitress skips what the socket took
    assert bytes(stream.read()) == b"gh" and bytes(stream.read(5)) == b"ij"
    assert stream.read() == b"" and stream.read(0) == b""
    with pytest.raises(ValueError):
        stream.seek(-1)
    stream.close()
    assert stream.read() == b""


# ---------------------------------------------------------------- bodies received in place


def raw_request(method: str, path: str, body: bytes, content_type: str = wire.CONTAINER_TYPE):
    head = (
        f"{method} {PREFIX}/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"X-Gmlx-Steps-Contract: 1.0\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """Read `count` answers (Content-Length framed) from a socket."""
    pending, got = b"", []
    while len(got) < count:
        while b"\r\n\r\n" not in pending:
            pending += sock.recv(65536)
        head, _, pending = pending.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(pending) < length:
            pending += sock.recv(65536)
        got.append((int(head.split(b" ")[1]), pending[:length]))
        pending = pending[length:]
    return got


def test_a_big_container_body_is_received_in_place(live, monkeypatch):
    reads = []
    original = GatedChannel._read_in_place

    def spy(channel, body):
        reads.append(body.remain)
        original(channel, body)

    monkeypatch.setattr(GatedChannel, "_read_in_place", spy)
    array = np.arange(IN_PLACE_MIN_BYTES // 2, dtype=np.float32).reshape(-1, 64)  # 128 KiB
    digest = tensor_hash(array)
    request_bytes = raw_request("PUT", f"tensors/{digest}", wire.write_container({"t": array}))
    with socket.create_connection(("127.0.0.1", live.thread.port), timeout=10) as sock:
        for start in range(0, len(request_bytes), 40_000):  # a slow client: many reads
            sock.sendall(request_bytes[start : start + 40_000])
            time.sleep(0.01)
        [(status, body)] = answers(sock, 1)
    assert status == 200, body
    assert len(reads) > 1 and reads == sorted(reads, reverse=True)  # the socket filled it
    held = live.ctx.service.tensors.get(digest)
    assert held is not None and np.array_equal(held.float32(), array)


def test_requests_pipelined_behind_an_in_place_body_are_answered(live):
    array = np.ones((1024, 64), dtype=np.float32)  # 256 KiB
    digest = tensor_hash(array)
    put = raw_request("PUT", f"tensors/{digest}", wire.write_container({"t": array}))
    head = raw_request("HEAD", f"tensors/{digest}", b"").replace(b"Content-Length: 0\r\n", b"")
    with socket.create_connection(("127.0.0.1", live.thread.port), timeout=10) as sock:
        sock.sendall(put + head + put)
        pending = b""
        while pending.count(b"HTTP/1.1 ") < 3:
            pending += sock.recv(65536)
    assert pending.count(b"HTTP/1.1 200 OK") == 3


def test_a_client_gone_mid_body_leaves_the_server_serving(live):
    array = np.ones((4096, 64), dtype=np.float32)  # 1 MiB
    request_bytes = raw_request(
        "PUT", f"tensors/{tensor_hash(array)}", wire.write_container({"t": array})
    )
    with socket.create_connection(("127.0.0.1", live.thread.port), timeout=10) as sock:
        sock.sendall(request_bytes[: len(request_bytes) // 2])
    assert live.call("GET", "capabilities", versioned=False).status_code == 200
    assert live.ctx.service.tensors.get(tensor_hash(array)) is None


def test_a_tensor_body_sent_to_a_json_route_is_refused_not_failed(live):
    body = wire.write_container({"t": np.zeros(IN_PLACE_MIN_BYTES, np.uint8)})
    response = live.session.post(
        live.base + "/v1/images/generations",
        data=body,
        headers={"Content-Type": wire.CONTAINER_TYPE},
        timeout=10,
    )
    assert response.status_code == 400, response.text


def test_no_room_for_a_body_in_place_falls_back_to_waitress_buffers(live, monkeypatch):
    def no_room(length):
        raise MemoryError

    monkeypatch.setattr(http_gate.BodyInPlace, "__init__", lambda self, length: no_room(length))
    array = np.full((1024, 64), 3.0, dtype=np.float32)  # 256 KiB
    assert live.put_tensor(array) == tensor_hash(array)
