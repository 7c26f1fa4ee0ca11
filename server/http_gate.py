"""Waitress' side of the body limits (CONTRACT 1.5, 1.9).

Waitress receives a whole request before the app sees it, so a size check in the app comes after
the body is in memory. Here the limit is applied where Waitress parses the request head: a body
whose Content-Length is over the limit for its content type (1 GiB + 1 MiB for the container
type, 64 MiB for anything else) is refused 413 before any byte of it is read, and a chunked body
as soon as it grows past the limit. Waitress' own refusals are answered in the nested JSON shape
of the app's gates.

A refused client is usually still sending its body. Closing a socket with unread input makes
the kernel send a reset, which can destroy the 413 before the client reads it; so the
connection is closed the way web servers do it ("lingering close"): the answer is sent, the
write side is shut, and what still arrives is read and dropped for a few seconds.
"""

from __future__ import annotations

import json
import socket
import time

from gmlx_contract import wire
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import BaseWSGIServer, create_server
from waitress.task import ErrorTask
from waitress.utilities import RequestEntityTooLarge

LINGER_S = 10.0  # how long a refused client may go on sending before the socket closes
DRAIN_BYTES = 256 * 1024

ERROR_KINDS = {413: "request_too_large", 431: "request_too_large", 500: "server_error"}


def body_limit(content_type: str | None) -> int:
    """The largest body a request of this content type may carry (the app's front gate too)."""
    return wire.MAX_CONTAINER_BYTES if wire.is_container_type(content_type) else wire.MAX_JSON_BYTES


class GatedParser(HTTPRequestParser):
    """Waitress' request parser with the contract's body limits."""

    body_limit = wire.MAX_CONTAINER_BYTES

    def parse_header(self, header_plus: bytes) -> None:
        super().parse_header(header_plus)
        self.body_limit = body_limit(self.headers.get("CONTENT_TYPE"))
        if self.content_length > self.body_limit:
            self._refuse(f"request body of {self.content_length} bytes")

    def received(self, data: bytes) -> int:
        consumed = super().received(data)
        body = self.body_rcv
        if self.chunked and not self.completed and body is not None:
            if len(body) > self.body_limit:
                self._refuse("chunked request body")
        return consumed

    def _refuse(self, what: str) -> None:
        self.error = RequestEntityTooLarge(f"{what} is over the limit of {self.body_limit} bytes")
        self.completed = True
        self.expect_continue = False  # never invite a body that will not be read
        self.body_rcv = None
        self.refused_body = True


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
        if not self.draining_until:
            super().handle_read()
            return
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
