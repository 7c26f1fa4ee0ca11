"""What every step route shares: reading bodies, writing answers, small checks."""

from __future__ import annotations

import bisect
import io
import itertools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import falcon
from gmlx_contract import wire
from gmlx_contract.errors import ContractError
from gmlx_contract.hashing import is_digest

from ..config import ServerConfig
from ..engine.registry import ModelRegistry
from ..service import StepsService

PREFIX = "/internal/image-steps/v1"
JSON_TYPE = "application/json"


class Traffic:
    """The requests the app is answering now (a streamed answer until its last event is
    taken), and whether the server is stopping: a stop refuses new requests and waits for
    these (cli.serve)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self.stopping = threading.Event()

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def enter(self) -> None:
        with self._lock:
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1


@dataclass
class ServerContext:
    """What the resources need: the configuration, the registry and the steps service."""

    config: ServerConfig
    registry: ModelRegistry
    service: StepsService
    group: Any = None  # the rank group (server/distributed.py), None for one process
    metrics: Any = None  # its metrics.ServerMetrics (GET /metrics), made by create_app
    traffic: Traffic = field(default_factory=Traffic)


class Resource:
    """Base of the step resources. `versioned` resources need the contract header."""

    versioned = True

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    @property
    def service(self) -> StepsService:
        return self.ctx.service

    @property
    def registry(self) -> ModelRegistry:
        return self.ctx.registry


# ---------------------------------------------------------------- answers


def send_json(resp: falcon.Response, doc: Any, status: int = 200) -> None:
    resp.status = status
    resp.content_type = JSON_TYPE
    resp.data = json.dumps(doc, separators=(",", ":")).encode("utf-8")


def send_container(resp: falcon.Response, pieces: Sequence[bytes | memoryview]) -> None:
    """Answer a container given as `wire.container_pieces`. As a stream, so Waitress sends it
    through `wsgi.file_wrapper`: each piece goes from its own memory to the socket, where
    `resp.data` would be copied into Waitress' output buffer and out again, and joining the
    pieces first would copy the tensors once more (2 MiB per copy at 1024x1024)."""
    stream = PiecesReader(pieces)
    resp.status = 200
    resp.content_type = wire.CONTAINER_TYPE
    resp.content_length = stream.size
    resp.stream = stream


class PiecesReader:
    """A read-only, seekable file over buffers laid end to end. `read` never crosses a
    piece's end, so it hands out views of the pieces themselves (Waitress' file wrapper seeks
    and reads this way, and sends each read as it comes)."""

    def __init__(self, pieces: Sequence[bytes | memoryview]) -> None:
        self._pieces = [memoryview(p).cast("B") for p in pieces if len(p)]
        self._starts = list(itertools.accumulate((len(p) for p in self._pieces), initial=0))
        self.size = self._starts[-1]
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes | memoryview:
        if self._pos >= self.size or size == 0:
            return b""
        index = bisect.bisect_right(self._starts, self._pos) - 1
        piece, within = self._pieces[index], self._pos - self._starts[index]
        end = len(piece) if size is None or size < 0 else min(len(piece), within + size)
        self._pos += end - within
        return piece[within:end]

    def close(self) -> None:
        self._pieces, self._starts, self.size, self._pos = [], [0], 0, 0


def send_empty(resp: falcon.Response, status: int) -> None:
    resp.status = status
    resp.data = b""


# ---------------------------------------------------------------- request bodies


def body_bytes(req: falcon.Request) -> bytes:
    """The request body, read once by the front gate (which checked its size first)."""
    return req.context.body


def json_body(req: falcon.Request) -> dict:
    """A JSON route's body: empty reads as {}, anything but a JSON object is refused 400."""
    doc = raw_json_body(req)
    if not isinstance(doc, dict):
        raise ContractError(400, f"the request body must be a JSON object, not {_kind(doc)}")
    return doc


def raw_json_body(req: falcon.Request) -> Any:
    """The parsed JSON document whatever its kind (patch tables check the object rule later);
    an empty body reads as {}."""
    if getattr(req.context, "json_parsed", False):
        return req.context.json
    body = bytes(body_bytes(req))  # a tensor body (sent here by mistake) arrives as a view
    if not body.strip():
        return {}
    try:
        return wire.load_json(body)
    except ValueError as error:
        raise ContractError(400, f"the request body is not JSON: {error}") from None


def is_container_request(req: falcon.Request) -> bool:
    return wire.is_container_type(req.get_header("Content-Type"))


def container_body(req: falcon.Request) -> wire.Container:
    """A tensor route's body: 415 for another content type, 413 over the limit, 400 malformed."""
    if not is_container_request(req):
        raise ContractError(
            415,
            f"send the tensors as Content-Type {wire.CONTAINER_TYPE}, not "
            f"{req.get_header('Content-Type') or 'none'}",
        )
    body = body_bytes(req)
    wire.check_body_size(len(body), wire.MAX_CONTAINER_BYTES)
    return wire.read_container(body)


def _kind(doc: Any) -> str:
    return {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(doc), "a number"
    )


# ---------------------------------------------------------------- small checks


def check_digest(digest: str) -> str:
    if not is_digest(digest):
        raise ContractError(400, f"digest {digest!r} must be 64 lowercase hexadecimal characters")
    return digest


def flag(fields: dict, name: str, default: bool) -> bool:
    value = fields.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ContractError(400, f"{name} must be true or false")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_pixels(width: int, height: int, what: str) -> None:
    """The pixel limits of steps and VAE passes (docs/contract.md §1.5): 413 over them."""
    if wire.over_pixel_limits(width, height):
        raise ContractError(
            413,
            f"{what} of {width}x{height} pixels is over the limit of {wire.MAX_PIXELS} pixels "
            f"(2048x2048) or {wire.MAX_SIDE} pixels a side",
        )


def model_field(fields: dict) -> Any:
    """The `model` member of a request: None where it names none (absent, null or ''), which
    means the default; any other value as sent, so that a non-string (false, 0, []) is refused
    where it is resolved, not taken for the default."""
    model = fields.get("model")
    return None if model == "" else model


def lone_surrogate(text: str) -> int | None:
    """Where a string holds a lone UTF-16 surrogate (JSON's "\\ud800"), which is no character
    and which no tokenizer reads; None where it holds none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None
