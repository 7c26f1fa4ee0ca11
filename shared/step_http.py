"""Keep-alive HTTP/1.1 connections for POST step, written for a step's sizes.

The step is the one call per sampler step, megabytes each way (2 MiB at 1024x1024 with two
rows). Through requests' urllib3 pool and http.client, a step spent about 0.5 ms more than this
(measured in `gmlx image bench --via-steps`, docs/benchmarks.md): the answer's head goes through
email.parser and its body through several reading layers into a new bytes object. Here the
request head and the container's pieces go out in one gathered send (`sendmsg`), the answer's
head is split by hand, and its body is received straight into one buffer of its length.

Only what a plain-TCP HTTP/1.1 server answers: `Content-Length`, chunked or until-close bodies,
interim 1xx answers skipped. TLS and proxies stay with requests (`StepClient` chooses).

A request is sent again only when it never reached the server: a kept connection found closed
before the request goes out, or failing while it is written, is replaced once; a connection
lost after the request went out is an error (the step may have run).
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from requests.structures import CaseInsensitiveDict

from .errors import ConnectTimedOut

MAX_HEAD_BYTES = 64 * 1024  # an answer head (status line and headers) longer than this is refused
READ_BYTES = 64 * 1024


class AnswerError(ConnectionError):
    """The server's answer could not be read (closed early, malformed, too long a head)."""


@dataclass
class Answer:
    status: int
    headers: CaseInsensitiveDict
    body: bytes | memoryview  # a read-only view of one buffer for a Content-Length body


class StepConnections:
    """Keep-alive connections to one server. Thread-safe: a call takes an idle connection or
    opens one, and gives it back once its answer is read whole."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.address = (host, port)
        self.timeout = timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def post(
        self, target: str, headers: Mapping[str, str], pieces: Sequence[bytes | memoryview]
    ) -> Answer:
        head = request_head(
            target, self.address, headers, sum(memoryview(p).nbytes for p in pieces)
        )
        sock, kept = self._take()
        try:
            try:
                send_all(sock, [head, *pieces])
            except OSError:
                if not kept:
                    raise
                sock.close()  # a kept connection the server had closed: once more, anew
                sock = self._connect()
                send_all(sock, [head, *pieces])
            answer, keep = read_answer(sock)
        except BaseException:
            sock.close()
            raise
        if keep:
            self._give_back(sock)
        else:
            sock.close()
        return answer

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _take(self) -> tuple[socket.socket, bool]:
        """A connection, and whether it is a kept one (not new)."""
        while True:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                return self._connect(), False
            if still_open(sock):
                return sock, True
            sock.close()

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout)
        except TimeoutError as exc:
            raise ConnectTimedOut(f"connecting took over {self.timeout:g} s") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def still_open(sock: socket.socket) -> bool:
    """A kept connection is usable while nothing is waiting to be read on it: readable means
    the server closed it (or sent something unasked)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def request_head(
    target: str, address: tuple[str, int], headers: Mapping[str, str], length: int
) -> bytes:
    host, port = address
    host = f"[{host}]" if ":" in host else host
    lines = [f"POST {target} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def send_all(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    """Send every piece, gathered (sendmsg takes what the socket buffer holds; go on after)."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def read_answer(sock: socket.socket) -> tuple[Answer, bool]:
    """Read one answer; returns it and whether the connection may carry another request."""
    reader = AnswerReader(sock)
    while True:
        version, status, headers = parse_head(reader.head())
        if not 100 <= status < 200 or status == 101:
            break
    keep = version == "HTTP/1.1" and "close" not in headers.get("Connection", "").lower()
    encoding = headers.get("Transfer-Encoding", "").lower()
    if "chunked" in encoding:
        body: bytes | memoryview = reader.chunked()
    elif "Content-Length" in headers:
        body = reader.exact(content_length(headers["Content-Length"]))
    else:
        body, keep = reader.until_close(), False
    return Answer(status, headers, body), keep


def parse_head(head: bytes) -> tuple[str, int, CaseInsensitiveDict]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise AnswerError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
    headers: CaseInsensitiveDict = CaseInsensitiveDict()
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise AnswerError(f"malformed header line in the answer: {line[:100]!r}")
        value = value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return version, int(code), headers


def content_length(value: str) -> int:
    if not value.strip().isdigit():
        raise AnswerError(f"the answer's Content-Length {value[:40]!r} is not a length")
    return int(value)


class AnswerReader:
    """Buffered reads of one answer; a body of known length lands in a buffer of its own."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def head(self) -> bytes:
        return self._through(b"\r\n\r\n", MAX_HEAD_BYTES, "the answer's head")

    def exact(self, length: int) -> memoryview:
        body = memoryview(np.empty(length, dtype=np.uint8))
        have = min(length, len(self.buffer))
        body[:have] = self.buffer[:have]
        del self.buffer[:have]
        while have < length:
            got = self.sock.recv_into(body[have:])
            if not got:
                raise AnswerError(f"the server closed the connection {length - have} bytes short")
            have += got
        return body.toreadonly()

    def chunked(self) -> bytes:
        parts = []
        while True:
            size_line = self._through(b"\r\n", 1024, "a chunk size line")
            size_text = size_line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise AnswerError(f"malformed chunk size {size_text[:20]!r}") from None
            if size == 0:
                while self._through(b"\r\n", MAX_HEAD_BYTES, "the trailer"):
                    pass
                return b"".join(parts)
            parts.append(bytes(self.exact(size)))
            if bytes(self.exact(2)) != b"\r\n":
                raise AnswerError("a chunk does not end with CRLF")

    def until_close(self) -> bytes:
        while self._fill():
            pass
        body, self.buffer = bytes(self.buffer), bytearray()
        return body

    def _through(self, end: bytes, limit: int, what: str) -> bytes:
        """The bytes before the next `end` (which is consumed)."""
        start = 0
        while (index := self.buffer.find(end, start)) < 0:
            if len(self.buffer) > limit:
                raise AnswerError(f"{what} is longer than {limit} bytes")
            start = max(0, len(self.buffer) - len(end) + 1)
            if not self._fill():
                raise AnswerError(f"the server closed the connection before {what} ended")
        found = bytes(self.buffer[:index])
        del self.buffer[: index + len(end)]
        return found

    def _fill(self) -> bool:
        data = self.sock.recv(READ_BYTES)
        self.buffer += data
        return bool(data)
