"""Waitress' side of the body limits (docs/contract.md §1.5, 1.9), and of receiving tensor bodies.

Waitress receives a whole request before the app sees it, so a size check in the app comes after
the body is in memory. Here the limit is applied where Waitress parses the request head: a body
whose Content-Length is over the limit for its content type (1 GiB + 1 MiB for the container
type, 64 MiB for anything else) is refused 413 before any byte of it is read, and a chunked body
as soon as it grows past the limit. Waitress' own refusals are answered in the nested JSON shape
of the app's gates, and logged with the same request line as the app's answers (`log_request`):
they never reach the app, whose front gate logs everything else.

A refused client is usually still sending its body. Closing a socket with unread input makes
the kernel send a reset, which can destroy the 413 before the client reads it; so the
connection is closed the way web servers do it ("lingering close"): the answer is sent, the
write side is shut, and what still arrives is read and dropped for a few seconds.

A container body of known length (a step's latents, an upload) is received in place: one buffer
of exactly its length, which the socket fills directly (`recv_into`). Waitress' own path reads
1 MiB chunks into new bytes objects and copies them into a growing buffer (and the first chunk,
read with the request head, twice more), which at 1024x1024 cost about half a millisecond of
the step's transport for 2 MiB.
"""

from __future__ import annotations

import functools
import io
import ipaddress
import json
import logging
import socket
import time

import numpy as np
from gmlx_contract import wire
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser, ParsingError, TransferEncodingNotImplemented
from waitress.receiver import FixedStreamReceiver
from waitress.server import BaseWSGIServer, create_server
from waitress.task import ErrorTask
from waitress.utilities import RequestEntityTooLarge
from waitress.wasyncore import _DISCONNECTED

log = logging.getLogger("gmlx.server")

LINGER_S = 10.0  # how long a refused client may go on sending before the socket closes
DRAIN_BYTES = 256 * 1024
# Reads of a request head: what follows the head in the same read is copied three times.
HEAD_READ_BYTES = 8 * 1024
IN_PLACE_MIN_BYTES = 64 * 1024  # container bodies from this length on are received in place

ERROR_KINDS = {413: "request_too_large", 431: "request_too_large", 500: "server_error"}
# A body framed by a transfer coding other than chunked: Waitress says 501 (it implements
# chunked alone); the request is what is wrong, so it is a 400 naming the header.
UNREAD_TRANSFER_CODING = (
    "Transfer-Encoding names a coding this server does not read: send the body with "
    "Content-Length, or Transfer-Encoding: chunked alone"
)


@functools.lru_cache(maxsize=1024)  # asked two or three times per request, of a few peers
def peer_is_loopback(peer: str | None) -> bool:
    """Loopback IPv4, IPv6 or IPv4-mapped loopback; an unknown peer is not."""
    if not peer:
        return False
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def log_request(
    method: str, path: str, status: int, started: float, peer: str | None = None
) -> None:
    """The one log line of each answered request: `POST /path 413 0.4 ms`, and `from PEER`
    where the peer is another machine (a server bound beyond loopback: whose the 401s are);
    control characters of the (decoded) path written escaped, so that no path writes a line of
    its own."""
    ms = (time.perf_counter() - started) * 1000.0
    if peer is None or peer_is_loopback(peer):
        log.info("%s %s %s %.1f ms", method, escaped(path), status, ms)
    else:
        log.info("%s %s %s %.1f ms from %s", method, escaped(path), status, ms, escaped(peer))


def escaped(text: str) -> str:
    """`text` with its control characters (newlines, NUL, ...) written as Python escapes."""
    if text.isprintable():  # every path but a hostile one: nothing to build per request
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def body_limit(content_type: str | None) -> int:
    """The largest body a request of this content type may carry (the app's front gate too)."""
    return wire.MAX_CONTAINER_BYTES if wire.is_container_type(content_type) else wire.MAX_JSON_BYTES


class GatedParser(HTTPRequestParser):
    """Waitress' request parser with the contract's body limits."""

    body_limit = wire.MAX_CONTAINER_BYTES
    refusal: RequestEntityTooLarge | None = None  # `_refuse`'s, which Waitress' must not replace

    def __init__(self, adj) -> None:
        super().__init__(adj)
        self.started = time.perf_counter()  # the request's first bytes are in

    def parse_header(self, header_plus: bytes) -> None:
        try:
            super().parse_header(header_plus)
        except TransferEncodingNotImplemented:  # Waitress' 501: it is the request that is wrong
            raise ParsingError(UNREAD_TRANSFER_CODING) from None
        content_type = self.headers.get("CONTENT_TYPE")
        self.body_limit = body_limit(content_type)
        if self.content_length > self.body_limit:
            self._refuse(f"request body of {self.content_length} bytes")
        elif (
            type(self.body_rcv) is FixedStreamReceiver
            and self.content_length >= IN_PLACE_MIN_BYTES
            and wire.is_container_type(content_type)
        ):
            try:
                self.body_rcv = BodyInPlace(self.content_length)
            except MemoryError:
                pass  # no room for it at once: Waitress' receiver grows with what arrives

    def body_in_place(self) -> BodyInPlace | None:
        """The in-place body still being received, if this request has one."""
        body = self.body_rcv
        return body if type(body) is BodyInPlace and not self.completed else None

    def received(self, data: bytes) -> int:
        consumed = super().received(data)
        if self.refusal is not None:  # past Waitress' bound too: it names its own, not the route's
            self.error = self.refusal
        body = self.body_rcv
        if self.chunked and not self.completed and body is not None:
            if len(body) > self.body_limit:
                self._refuse("chunked request body")
        return consumed

    def _refuse(self, what: str) -> None:
        self.error = self.refusal = RequestEntityTooLarge(
            f"{what} is over the limit of {self.body_limit} bytes"
        )
        self.completed = True
        self.expect_continue = False  # never invite a body that will not be read
        self.body_rcv = None
        self.refused_body = True


class BodyInPlace:
    """Waitress' body receiver (the interface of its FixedStreamReceiver) for a body of known
    length, held in one buffer of exactly that length. `GatedChannel` receives into `free()`
    and then tells the parser, through the usual path, with the view of what landed there."""

    completed = False
    error = None

    def __init__(self, length: int) -> None:
        # np.empty: no zero fill of megabytes that the socket overwrites at once.
        self.buffer = memoryview(np.empty(length, dtype=np.uint8))
        self.filled = 0
        self._landed = 0

    def __len__(self) -> int:
        return self.filled

    @property
    def remain(self) -> int:
        return len(self.buffer) - self.filled

    def free(self) -> memoryview:
        return self.buffer[self.filled :]

    def landed(self, count: int) -> memoryview:
        """Mark `count` bytes as received into `free()`; returns them, for `received`."""
        self._landed = count
        return self.buffer[self.filled : self.filled + count]

    def received(self, data) -> int:
        count = min(len(data), self.remain)
        if self._landed:  # already in place: data is the view `landed` returned
            count, self._landed = self._landed, 0
        else:  # body bytes that came in the same read as the request head
            self.buffer[self.filled : self.filled + count] = data[:count]
        self.filled += count
        self.completed = self.filled == len(self.buffer)
        return count

    def getfile(self) -> ReceivedBody:
        return ReceivedBody(self.buffer[: self.filled])

    def getbuf(self) -> BodyInPlace:
        return self

    def close(self) -> None:
        pass  # the buffer goes when the last view of it does


class ReceivedBody(io.RawIOBase):
    """`wsgi.input` over a body received in place. `take_whole` hands the app the buffer
    itself (see app.whole_body); reads copy, as any stream's do."""

    def __init__(self, body: memoryview) -> None:
        super().__init__()
        self._body = body
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self._body[self._pos : self._pos + len(target)]
        target[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._body) if size is None or size < 0 else self._pos + size
        chunk = bytes(self._body[self._pos : end])
        self._pos += len(chunk)
        return chunk

    def take_whole(self) -> memoryview | None:
        """The whole body as a view, marked read; None once anything was read."""
        if self._pos:
            return None
        self._pos = len(self._body)
        return self._body


class JsonErrorTask(ErrorTask):
    """Waitress' refusals (400 bad request line, 413, 431, ...) in the nested JSON shape."""

    def execute(self) -> None:
        error = self.request.error
        kind = ERROR_KINDS.get(error.code, "invalid_request_error")
        message = str(error.body).strip() or error.reason
        body = json.dumps({"error": {"type": kind, "message": message}}).encode("utf-8")
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)
        request = self.request
        started = getattr(request, "started", None) or time.perf_counter()
        log_request(
            getattr(request, "command", None) or "-",
            getattr(request, "path", None) or "-",
            error.code,
            started,
            _peer_of(self.channel),
        )


def _peer_of(channel) -> str | None:
    """The address of a channel's client (None where the socket names none)."""
    addr = getattr(channel, "addr", None)
    return addr[0] if isinstance(addr, tuple) and addr else None


class GatedChannel(HTTPChannel):
    """An HTTP channel with the gated parser, JSON refusals and a lingering close after a
    refused body."""

    parser_class = GatedParser
    error_task_class = JsonErrorTask
    draining_until = 0.0

    def service(self) -> None:
        if self.requests and getattr(self.requests[0], "refused_body", False):
            self.linger = True
        super().service()

    def handle_close(self) -> None:
        if getattr(self, "linger", False) and not self.draining_until and self.socket is not None:
            try:
                self.socket.shutdown(socket.SHUT_WR)  # the answer is out; then FIN
            except OSError:
                pass
            else:
                self.draining_until = time.monotonic() + LINGER_S
                return
        super().handle_close()

    def readable(self) -> bool:
        return True if self.draining_until else super().readable()

    def writable(self) -> bool:
        if self.draining_until:
            return time.monotonic() > self.draining_until  # then handle_write closes
        return super().writable()

    def handle_read(self) -> None:
        if self.draining_until:
            self._drain()
            return
        body = self.request.body_in_place() if self.request is not None else None
        if body is not None:
            self._read_in_place(body)
            return
        in_head = self.request is None or self.request.body_rcv is None
        try:
            data = self.recv(HEAD_READ_BYTES if in_head else self.adj.recv_bytes)
        except OSError:
            self._socket_error()
            return
        if not data:
            self.connected = False  # the client disconnected
            return
        self.last_activity = time.time()
        self.received(data)
        body = self.request.body_in_place() if self.request is not None else None
        if body is not None and self.connected:
            self._read_in_place(body)  # the body most often follows its head: no poll between

    def _read_in_place(self, body: BodyInPlace) -> None:
        """Receive into the body's buffer for as long as bytes are waiting."""
        while not body.completed:
            try:
                count = self.socket.recv_into(body.free())
            except (BlockingIOError, InterruptedError):
                return  # the rest is still on its way: back to the poll loop
            except OSError as error:
                if error.args[0] in _DISCONNECTED:
                    self.handle_close()
                    self.connected = False
                else:
                    self._socket_error()
                return
            if not count:  # the client disconnected mid-body
                self.handle_close()
                self.connected = False
                return
            self.last_activity = time.time()
            if not self.received(body.landed(count)):
                return  # the channel is closing

    def _socket_error(self) -> None:
        if self.adj.log_socket_errors:
            self.logger.exception("Socket error")
        self.handle_close()

    def _drain(self) -> None:
        try:
            data = self.socket.recv(DRAIN_BYTES)  # dropped
        except OSError:
            data = b""
        if not data or time.monotonic() > self.draining_until:
            super().handle_close()


def gated_server(app, **options):
    """`waitress.server.create_server` whose connections use `GatedChannel`."""
    socket_map: dict = {}
    server = create_server(app, map=socket_map, **options)
    for dispatcher in socket_map.values():
        if isinstance(dispatcher, BaseWSGIServer):
            dispatcher.channel_class = GatedChannel
    return server
