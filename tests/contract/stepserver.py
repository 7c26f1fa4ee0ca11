"""A tiny scripted step server for the client tests: http.server on an ephemeral port in a
thread. It keeps just enough state (tensor and adapter stores by verified hash, patch tables)
to answer like the contract says, records every request, and lets a test override any
route's answer."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
from gmlx_contract.errors import ContractError
from gmlx_contract.hashing import hash_parts, table_id, tensor_hash
from gmlx_contract.version import HEADER, check_request_version
from gmlx_contract.wire import CONTAINER_TYPE, read_container, write_container

PREFIX = "/internal/image-steps/v1/"


@dataclass
class Seen:
    method: str
    path: str  # relative to the prefix, or the raw path outside it (e.g. "/health")
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    port: int


@dataclass
class Answer:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def json_answer(status: int, doc) -> Answer:
    return Answer(status, json.dumps(doc).encode())


class FakeStepServer:
    def __init__(self, api_key: str | None = None):
        self.api_key = api_key
        self.capabilities = {
            "contract": {"major": 1, "minor": 0},
            "min_client": {"major": 1, "minor": 0},
            "gmlx_version": "0.1.0",
        }
        self.seen: list[Seen] = []
        self.overrides: dict[tuple[str, str], Callable[[Seen], Answer] | Answer] = {}
        self.tensors: dict[str, bytes] = {}
        self.adapters: set[str] = set()
        self.tables: dict[str, dict] = {}
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeStepServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def requests_to(self, method: str, path: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method and s.path == path]

    # ------------------------------------------------------------ dispatch

    def answer(self, seen: Seen) -> Answer:
        self.seen.append(seen)
        override = self.overrides.get((seen.method, seen.path))
        if override is not None:
            return override(seen) if callable(override) else override
        if seen.path == "/health":
            return json_answer(200, {"status": "ok"})
        if self.api_key and seen.headers.get("authorization") != f"Bearer {self.api_key}":
            return json_answer(
                401, {"error": {"type": "authentication_error", "message": "invalid API key"}}
            )
        try:
            if seen.path != "capabilities":
                check_request_version(seen.headers.get(HEADER.lower()))
            return self._route(seen)
        except ContractError as error:
            return json_answer(error.status, error.body)

    def _route(self, seen: Seen) -> Answer:
        kind, _, rest = seen.path.partition("/")
        if seen.path == "capabilities":
            return json_answer(200, self.capabilities)
        if kind in ("tensors", "adapters"):
            return self._upload(seen, kind, rest)
        if kind == "patch-tables":
            return self._table(seen, rest)
        if seen.path == "step":
            return self._step(seen)
        if seen.path == "encode":
            return self._encode(seen)
        if seen.path == "models":
            return json_answer(200, {"models": [], "default_model": None})
        if kind == "models" and rest.endswith("/status"):
            return json_answer(200, {"model": unquote(rest[: -len("/status")])})
        if seen.path == "runs/begin":
            return json_answer(200, {"run": "0123456789abcdef", "idle_s": 120.0})
        if kind == "runs" and rest.endswith("/end"):
            return json_answer(200, {"run": rest[:-4], "ended": True})
        if seen.path == "interrupt":
            return json_answer(200, {"interrupted": int(json.loads(seen.body)["run"] is not None)})
        if seen.path == "vae/decode":
            latents = read_container(seen.body).tensors["latents"]
            image = np.transpose(latents, (0, 2, 3, 1)).astype(np.float32)
            return container_answer({"image": image})
        raise ContractError(404, f"no route {seen.method} {seen.path}")

    def _upload(self, seen: Seen, kind: str, digest: str) -> Answer:
        held = self.tensors if kind == "tensors" else self.adapters
        if seen.method == "HEAD":
            return Answer(200 if digest in held else 404)
        parsed = read_container(seen.body)
        if len(parsed.tensors) != 1:
            raise ContractError(400, "exactly one tensor")
        (name,) = parsed.tensors
        got = hash_parts(parsed.dtypes[name], parsed.tensors[name].shape, parsed.raw(name))
        if got != digest:
            raise ContractError(400, "hash differs", got=got)
        if kind == "tensors":
            self.tensors[digest] = seen.body
        else:
            self.adapters.add(digest)
        return json_answer(200, {"hash": digest})

    def _table(self, seen: Seen, digest: str) -> Answer:
        doc = json.loads(seen.body)
        if table_id(doc) != digest:
            raise ContractError(400, "id differs", got=table_id(doc))
        named = {p[k] for e in doc["entries"] for p in e["patches"] for k in ("up", "down")}
        missing = sorted(named - self.adapters)
        if missing:
            raise ContractError(409, "adapters not held", missing=missing)
        self.tables[digest] = doc
        return json_answer(200, {"id": digest})

    def _step(self, seen: Seen) -> Answer:
        parsed = read_container(seen.body)
        rows = parsed.fields["rows"]
        named = {h for row in rows for h in [row["cond"], *row.get("ref_latents", [])]}
        missing = sorted(named - set(self.tensors))
        table = parsed.fields.get("patch_table")
        if table is not None and table not in self.tables:
            missing = sorted([*missing, table])
        if missing:
            raise ContractError(409, "not held", missing=missing)
        out = parsed.tensors["x"].astype(np.float32) * 2.0
        headers = {
            "X-Gmlx-Forward-Ms": "12.34",
            "X-Gmlx-Server-Ms": "15.00",
            "X-Gmlx-Prefix-Cache": "miss",
        }
        return container_answer({"out": out}, headers=headers)

    def _encode(self, seen: Seen) -> Answer:
        if seen.headers.get("content-type") == CONTAINER_TYPE:
            parsed = read_container(seen.body)
            fields, images = parsed.fields, list(parsed.tensors.values())
        else:
            fields, images = json.loads(seen.body), []
        cond = np.full((1, len(fields["text"]), 4), float(len(images)), np.float32)
        digest = tensor_hash(cond)
        self.tensors[digest] = b"held"
        answer_fields = {
            "cond": digest,
            "ref_latents": [],
            "image_slots": [0] * len(images),
            "num_tokens": cond.shape[1],
        }
        return container_answer({"cond": cond}, answer_fields)


def container_answer(tensors, fields=None, headers=None) -> Answer:
    return Answer(200, write_container(tensors, fields), CONTAINER_TYPE, headers or {})


def send_answer(handler: BaseHTTPRequestHandler, status: int, headers: dict, body: bytes) -> None:
    """Write one HTTP answer: its status, its headers and length, and its body (not to HEAD)."""
    handler.send_response(status)
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


def _handler_for(server: FakeStepServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the contract asks
        disable_nagle_algorithm = True  # headers and body go out in two writes

        def _serve(self) -> None:
            split = urlsplit(self.path)
            path = split.path
            path = path[len(PREFIX) :] if path.startswith(PREFIX) else path
            length = int(self.headers.get("Content-Length") or 0)
            seen = Seen(
                method=self.command,
                path=path,
                query=parse_qs(split.query),
                headers={k.lower(): v for k, v in self.headers.items()},
                body=self.rfile.read(length),
                port=self.client_address[1],
            )
            answer = server.answer(seen)
            headers = {"Content-Type": answer.content_type, **answer.headers}
            send_answer(self, answer.status, headers, answer.body)

        do_GET = do_POST = do_PUT = do_HEAD = _serve

        def log_message(self, *args) -> None:
            pass

    return Handler
