"""The step's own HTTP/1.1 connections (gmlx_contract.step_http) against a scripted server:
answers in every body framing, kept and closed connections, and answers it must refuse."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from gmlx_contract.step_http import AnswerError, StepConnections


class ScriptedServer:
    """Accepts connections; for each request (head + Content-Length body) sends the next
    scripted answer (bytes), or closes the connection when the script says None."""

    def __init__(self, answers: list[bytes | None], close_after_answer: bool = False) -> None:
        self.answers = list(answers)
        self.close_after_answer = close_after_answer
        self.requests: list[tuple[bytes, bytes, int]] = []  # (head, body, connection number)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._talk, args=(conn, self.connections), daemon=True).start()

    def _talk(self, conn: socket.socket, number: int) -> None:
        pending = b""
        with conn:
            while self.answers:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(pending) < length:
                    pending += conn.recv(1 << 20)
                body, pending = pending[:length], pending[length:]
                self.requests.append((head, body, number))
                answer = self.answers.pop(0)
                if answer is None:
                    return
                if answer == ECHO:
                    answer = ok(body)
                conn.sendall(answer)
                if self.close_after_answer:
                    return

    def link(self) -> StepConnections:
        return StepConnections("127.0.0.1", self.port, timeout=10.0)


ECHO = b"echo"  # a script entry: answer the request's own body


def ok(body: bytes, extra: str = "") -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/x-test\r\n{extra}"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def test_a_big_body_goes_out_whole_and_the_answer_lands_in_one_buffer():
    payload = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: more than one sendmsg takes
    answer = np.arange(3 << 18, dtype=np.float32).tobytes()
    server = ScriptedServer([ok(answer), ok(b"again")])
    link = server.link()
    got = link.post("/p", {"X-Test": "1"}, [b"head:", payload.data, b":tail"])
    assert got.status == 200 and got.headers["content-type"] == "application/x-test"
    assert bytes(got.body) == answer and got.body.readonly
    head, body, _ = server.requests[0]
    assert body == b"head:" + payload.tobytes() + b":tail"
    assert head.startswith(b"POST /p HTTP/1.1\r\nHost: 127.0.0.1:") and b"X-Test: 1" in head
    assert bytes(link.post("/p", {}, [b"x"]).body) == b"again"
    assert server.connections == 1  # kept alive


def test_chunked_until_close_and_interim_answers():
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n"
    )
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after")
    until_close = b"HTTP/1.0 200 OK\r\nX-A: 1\r\nX-A: 2\r\n\r\nto the end"
    server = ScriptedServer([chunked, interim, until_close])
    link = server.link()
    assert link.post("/", {}, [b"1"]).body == b"hello world"
    assert bytes(link.post("/", {}, [b"2"]).body) == b"after"
    third = link.post("/", {}, [b"3"])
    assert third.body == b"to the end" and third.headers["x-a"] == "1, 2"
    assert server.connections == 1 and not link._idle  # read until close: not kept


def test_connection_close_is_honoured_and_a_closed_kept_connection_replaced():
    server = ScriptedServer([ok(b"a", "Connection: close\r\n"), ok(b"b"), ok(b"c")])
    link = server.link()
    assert bytes(link.post("/", {}, [b"1"]).body) == b"a"
    assert bytes(link.post("/", {}, [b"2"]).body) == b"b"  # a new connection
    assert server.connections == 2
    closing = ScriptedServer([ok(b"x"), ok(b"y")], close_after_answer=True)
    link = closing.link()
    assert bytes(link.post("/", {}, [b"1"]).body) == b"x"
    time.sleep(0.05)  # the server has closed the kept connection meanwhile
    assert bytes(link.post("/", {}, [b"2"]).body) == b"y"
    assert closing.connections == 2 and len(closing.requests) == 2  # sent once each


def test_a_request_that_went_out_is_not_sent_again():
    server = ScriptedServer([None, ok(b"never")])  # reads the request, closes unanswered
    with pytest.raises(AnswerError, match="closed the connection"):
        server.link().post("/", {}, [b"step"])
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n", "not a length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "5 bytes short"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, "longer than"),
    ],
)
def test_malformed_answers_are_answer_errors(answer, message):
    server = ScriptedServer([answer, None], close_after_answer=True)
    with pytest.raises(AnswerError, match=message):
        server.link().post("/", {}, [b"step"])


def test_nothing_listening_is_a_connection_error():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(OSError):
        StepConnections("127.0.0.1", port, timeout=2.0).post("/", {}, [b"x"])


def test_an_answer_that_never_comes_times_out():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    link = StepConnections("127.0.0.1", listener.getsockname()[1], timeout=0.3)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        link.post("/", {}, [b"step"])
    assert 0.25 < time.monotonic() - started < 5.0
    listener.close()


def test_threads_sharing_the_connections_each_get_their_own_answer():
    server = ScriptedServer([ECHO] * 40)
    link = server.link()
    got: dict[int, list[bytes]] = {}

    def client(number: int) -> None:
        got[number] = [
            bytes(link.post("/", {}, [f"{number}:{i}".encode()]).body) for i in range(10)
        ]

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert got == {n: [f"{n}:{i}".encode() for i in range(10)] for n in range(4)}
    assert 1 <= server.connections <= 4  # kept connections reused, at most one per thread
