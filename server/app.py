"""The Falcon app: front gates, error shapes, the routes; and serving it on Waitress.

Order of checks on a request (docs/contract.md §1.2, 1.9, 4):
  1. host guard (loopback bind: non-loopback peers and Host headers)    403 nested
  2. API key (every path but /health and the OpenAI images by URL)     401 nested
  3. step gate (non-loopback or unknown peer without steps_remote)      403 flat
  4. size gate (Content-Length against the limit, before reading)       413 nested
  5. JSON gate (a non-container body must be JSON)                       400 nested
  6. contract version header (every step route but capabilities)        400 flat
  7. the route's own checks                                              flat
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import threading
import time
from http import HTTPStatus
from typing import Any

import falcon
from gmlx_contract import version, wire
from gmlx_contract.errors import ContractError

from . import openai
from .config import ServerConfig, is_loopback_host
from .engine.registry import ModelRegistry
from .http_gate import ReceivedBody, body_limit, gated_server, log_request, peer_is_loopback
from .metrics import Metrics, MetricsMiddleware, ServerMetrics
from .routes import encode, models, runs, step, uploads, vae
from .routes.common import PREFIX, Resource, ServerContext, Traffic
from .service import StepsService
from .worker import ImageWorker, WorkerStopped

log = logging.getLogger("gmlx.server")
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# What every request gets while the server stops (503), and one a stop at once cut short.
STOPPING = "the server is stopping: send the request again once it is back, or to another"


class GateError(Exception):
    """A refusal of the front middleware, answered in the nested shape
    {"error": {"type": ..., "message": ...}} (docs/contract.md §1.9)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def nested_body(kind: str, message: str) -> bytes:
    return json.dumps({"error": {"type": kind, "message": message}}).encode("utf-8")


def flat_body(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def host_header_name(host: str | None) -> str:
    """The name part of a Host header ("[::1]:8080" -> "::1", "localhost:80" -> "localhost")."""
    host = (host or "").strip()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


class FrontGate:
    """Access, size and JSON checks, before routing; also the request log line (of every request
    that reaches the app: Waitress' own refusals are logged where they are made, in http_gate)."""

    def __init__(self, config: ServerConfig, traffic: Traffic) -> None:
        self.config = config
        self.traffic = traffic
        self.key = config.api_key.encode("utf-8") if config.api_key else None

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.started = time.perf_counter()
        self.traffic.enter()
        req.context.counted = True
        if self.traffic.stopping.is_set() and req.path != HEALTH_PATH:
            raise GateError(503, "server_error", STOPPING)
        peer = req.env.get("REMOTE_ADDR")
        req.context.peer = peer
        if self.config.loopback_bind:
            self._host_guard(req, peer)
        if self.key is not None and not self._keyless(req.path):
            self._check_key(req)
        if req.path.startswith(PREFIX + "/") and self.config.image.steps_api:
            self._step_gate(peer)
        req.context.body = self._read_body(req)
        req.context.gate_passed = time.perf_counter()

    @staticmethod
    def _keyless(path: str) -> bool:
        """/health, and the OpenAI routes' images by URL, whose random names are their key."""
        return path == HEALTH_PATH or path.startswith(openai.FILES_PREFIX)

    def _host_guard(self, req: falcon.Request, peer: str | None) -> None:
        if not peer_is_loopback(peer):
            raise GateError(
                403,
                "permission_error",
                f"this server listens on loopback only and refuses peer {peer or 'unknown'}",
            )
        name = host_header_name(req.get_header("Host"))
        if name and not is_loopback_host(name):
            raise GateError(
                403,
                "permission_error",
                f"Host {name!r} is not a loopback name; this server answers localhost only",
            )

    def _check_key(self, req: falcon.Request) -> None:
        sent = None
        auth = req.get_header("Authorization") or ""
        if auth[:7].lower() == "bearer ":
            sent = auth[7:].strip()
        if sent is None:
            sent = req.get_header("X-Api-Key")
        if sent is None or not hmac.compare_digest(sent.encode("utf-8"), self.key):
            raise GateError(
                401,
                "authentication_error",
                "a valid API key is required: send Authorization: Bearer <key> or x-api-key",
            )

    def _step_gate(self, peer: str | None) -> None:
        if self.config.image.steps_remote or peer_is_loopback(peer):
            return
        raise ContractError(
            403,
            f"the image step routes serve loopback peers only; peer {peer or 'unknown'} is "
            "refused. Set server.image.steps_remote = true to serve other peers (with the API "
            "key), or run the client on the server's machine",
        )

    def _read_body(self, req: falcon.Request) -> bytes:
        container = wire.is_container_type(req.content_type)
        limit = body_limit(req.content_type)
        length = req.content_length
        if length is not None and length > limit:
            raise GateError(
                413,
                "request_too_large",
                f"request body of {length} bytes is over the limit of {limit} bytes",
            )
        body = whole_body(req)
        if body is None:
            body = (
                req.bounded_stream.read(limit + 1) if length is None else req.bounded_stream.read()
            )
        if len(body) > limit:
            raise GateError(
                413, "request_too_large", f"request body is over the limit of {limit} bytes"
            )
        req.context.json_parsed = False
        # Multipart bodies (OpenAI image edits) are read by their route, not as JSON.
        multipart = (req.content_type or "").split(";", 1)[0].strip() == "multipart/form-data"
        if body and not container and not multipart and body.strip():
            try:
                req.context.json = wire.load_json(body)
            except ValueError as error:
                # tensor containers are the step routes' alone: an OpenAI client is not told
                hint = (
                    ""
                    if _in_openai(req)
                    else f": {error} (tensor bodies need {wire.CONTAINER_TYPE})"
                )
                raise GateError(
                    400, "invalid_request_error", "the request body is not JSON" + hint
                ) from None
            req.context.json_parsed = True
        return body

    def process_resource(self, req, resp, resource: Any, params: dict) -> None:
        if getattr(resource, "versioned", False):
            version.check_request_version(req.get_header(version.HEADER))

    def process_response(self, req, resp, resource, req_succeeded: bool) -> None:
        started = getattr(req.context, "started", None) or time.perf_counter()
        log_request(
            req.method, req.path, resp.status_code, started, getattr(req.context, "peer", None)
        )
        if getattr(req.context, "counted", False):
            self.traffic.leave()


def whole_body(req: falcon.Request) -> bytes | memoryview | None:
    """The body as the buffer Waitress already holds, without a copy, or None.

    A container body arrives in place (http_gate.BodyInPlace): its buffer itself. Any other
    body comes as a BytesIO Waitress filled with exactly Content-Length bytes, whose
    getvalue() is that buffer, where reading the stream would copy it (2 MiB per 1024x1024
    step)."""
    stream = req.env.get("wsgi.input")
    length = req.content_length
    if length is None:
        return None
    if type(stream) is ReceivedBody:
        body = stream.take_whole()
    elif type(stream) is io.BytesIO and stream.tell() == 0:
        body = stream.getvalue()
        stream.seek(len(body))  # read, as far as anyone reading after us can tell
    else:
        return None
    return body if body is not None and len(body) == length else None


# ---------------------------------------------------------------- error shapes


def _in_steps(req: falcon.Request) -> bool:
    return req.path.startswith(PREFIX + "/")


def _in_openai(req: falcon.Request) -> bool:
    return req.path.startswith(openai.PREFIX)


def handle_contract_error(req, resp, exc: ContractError, params) -> None:
    resp.status = exc.status
    resp.content_type = "application/json"
    resp.data = flat_body(exc.body)


def handle_gate_error(req, resp, exc: GateError, params) -> None:
    resp.status = exc.status
    resp.content_type = "application/json"
    if _in_openai(req):  # OpenAI's error object, `param` and `code` included
        resp.data = openai.OpenAIError(exc.status, exc.message, kind=exc.kind).body()
    else:
        resp.data = nested_body(exc.kind, exc.message)


def handle_http_error(req, resp, exc: falcon.HTTPError, params) -> None:
    """Falcon's own refusals (no route, method not allowed, ...) in the nested shape."""
    resp.status = exc.status
    resp.content_type = "application/json"
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "error")
    resp.data = nested_body(kind, HTTPStatus(exc.status_code).phrase)
    for name, value in (exc.headers or {}).items():
        resp.set_header(name, value)


def handle_value_error(req, resp, exc: ValueError, params) -> None:
    """A value error anywhere in a step route's work is the client's: 400 with its text."""
    if not _in_steps(req):
        handle_unexpected(req, resp, exc, params)
        return
    resp.status = 400
    resp.content_type = "application/json"
    resp.data = flat_body({"error": str(exc) or type(exc).__name__})


def handle_worker_stopped(req, resp, exc: WorkerStopped, params) -> None:
    """A request a stop at once cut short, its model let go under it: 503, as the gate answers
    every request during a stop, not a 500 with a traceback."""
    log.info("%s %s cut short by the stop", req.method, req.path)
    handle_gate_error(req, resp, GateError(503, "server_error", STOPPING), params)


def handle_unexpected(req, resp, exc: Exception, params) -> None:
    log.exception("%s %s failed", req.method, req.path, exc_info=exc)
    resp.status = 500
    resp.content_type = "application/json"
    if _in_steps(req):
        template = req.uri_template or req.path
        text = f"internal error in {req.method} {template}: {type(exc).__name__}"
        resp.data = flat_body({"error": text})
    else:
        resp.data = nested_body("server_error", f"internal error: {type(exc).__name__}")


# ---------------------------------------------------------------- the app


def create_app(ctx: ServerContext) -> falcon.App:
    if ctx.metrics is None:  # one app's metrics, counted over its context
        ctx.metrics = ServerMetrics(ctx.service, ctx.group)
    gate = FrontGate(ctx.config, ctx.traffic)
    app = falcon.App(middleware=[gate, MetricsMiddleware(ctx.metrics)])
    app.req_options.strip_url_path_trailing_slash = False
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(ValueError, handle_value_error)
    app.add_error_handler(falcon.HTTPError, handle_http_error)
    app.add_error_handler(ContractError, handle_contract_error)
    app.add_error_handler(GateError, handle_gate_error)
    app.add_error_handler(WorkerStopped, handle_worker_stopped)
    app.add_route(HEALTH_PATH, models.Health(ctx))
    app.add_route(METRICS_PATH, Metrics(ctx.metrics))
    if ctx.config.image.steps_api:
        for path, resource in step_routes(ctx):
            app.add_route(PREFIX + "/" + path, resource)
    openai.add_routes(app, ctx)
    return app


def step_routes(ctx: ServerContext) -> list[tuple[str, Resource]]:
    return [
        ("capabilities", models.Capabilities(ctx)),
        ("models", models.Models(ctx)),
        ("models/{model}/status", models.ModelStatus(ctx)),
        ("models/{model}/manifest", models.ModelManifest(ctx)),
        ("models/load", models.LoadModel(ctx)),
        ("models/unload", models.UnloadModel(ctx)),
        ("encode", encode.Encode(ctx)),
        ("tensors/{digest}", uploads.CachedUpload(ctx, "tensors")),
        ("adapters/register", uploads.RegisterAdapters(ctx)),
        ("adapters/{digest}", uploads.CachedUpload(ctx, "adapters")),
        ("patch-tables/{digest}", uploads.PatchTables(ctx)),
        ("step", step.Step(ctx)),
        ("vae/decode", vae.VaeDecode(ctx)),
        ("vae/encode", vae.VaeEncode(ctx)),
        ("runs/begin", runs.BeginRun(ctx)),
        ("runs/{run}/end", runs.EndRun(ctx)),
        ("interrupt", runs.Interrupt(ctx)),
    ]


def build_context(
    config: ServerConfig, registry: ModelRegistry, group: Any = None
) -> ServerContext:
    """The registry, a started worker and service, ready for `create_app`; with a rank `group`
    (server/distributed.py) the worker is the group's, which refuses work the group cannot do."""
    if group is None:
        worker = ImageWorker()
    else:
        from .distributed import GroupWorker

        worker = GroupWorker(group)
    service = StepsService(registry, worker, config.image)
    service.start()
    return ServerContext(config=config, registry=registry, service=service, group=group)


# ---------------------------------------------------------------- Waitress

# Step bodies reach megabytes: 16 rows of 64x128x128 float32 latents are 64 MiB each way, and a
# VAE decode of 16 RGBA 2048x2048 images answers 1 GiB. No body may spill to a temporary file
# (nothing a request carries is written to disk), so the buffers hold the largest body the gate
# lets in, plus one read that may carry a chunked body past its limit before it is refused.
# One read per MiB of body: a 2 MiB step body arrives in 2-3 passes of Waitress' loop instead of
# 8-10 (256 KiB reads), 0.42 -> 0.30 ms at 1024x1024; Python shrinks each read to what came.
RECV_BYTES = 1024 * 1024
BUFFER_BYTES = wire.MAX_CONTAINER_BYTES + RECV_BYTES + 1


def waitress_options(config: ServerConfig) -> dict:
    return {
        "threads": config.threads,
        "inbuf_overflow": BUFFER_BYTES,
        "outbuf_overflow": BUFFER_BYTES,
        "outbuf_high_watermark": 2 * BUFFER_BYTES,
        "recv_bytes": RECV_BYTES,
        # Waitress' own check refuses Content-Length >= this; http_gate refuses a body over the
        # limit of its content type before reading it, so this only backs it up.
        "max_request_body_size": BUFFER_BYTES,
        "channel_timeout": 300,
        # A channel keeps reading while its request runs, so that a client that closes its
        # connection is noticed (`waitress.client_disconnected`: an OpenAI image job stops);
        # one more request may be read ahead of the one running.
        "channel_request_lookahead": 1,
        "ident": "gmlx",
        "clear_untrusted_proxy_headers": True,
    }


def make_server(app: falcon.App, config: ServerConfig, port: int | None = None):
    """A Waitress server for the app (port 0: an ephemeral port, see `.effective_port`)."""
    port = config.port if port is None else port
    return gated_server(app, host=config.host, port=port, **waitress_options(config))


class ServerThread:
    """Run a Waitress server on a thread of its own, and stop it cleanly from another thread
    (closing its sockets from outside would race the poll loop). For tests and the bench."""

    def __init__(self, server) -> None:
        self.server = server
        self._stop = threading.Event()
        self._closing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="gmlx-http", daemon=True)

    @property
    def port(self) -> int:
        return self.server.effective_port

    def start(self) -> ServerThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._closing:
            self._stop.set()
            if not self._closed:
                self.server.pull_trigger()  # wake the poll loop now
        self._thread.join(timeout)

    def _loop(self) -> None:
        from waitress import wasyncore

        try:
            while not self._stop.is_set():
                wasyncore.loop(timeout=1.0, map=self.server._map, count=1)
        except Exception:
            log.exception("the HTTP server loop failed")
            raise
        finally:
            with self._closing:  # never pull a trigger whose pipe is closed (or reused)
                self._closed = True
                self._close_connections()
                self.server.close()
            # Waitress' request threads outlive the loop unless told to stop.
            self.server.task_dispatcher.shutdown(timeout=5)

    def _close_connections(self) -> None:
        """Close the open client connections too: left open with no loop reading them, a
        keep-alive client would send its next request into a socket nobody answers."""
        from waitress.channel import HTTPChannel

        for dispatcher in list(self.server._map.values()):
            if isinstance(dispatcher, HTTPChannel):
                try:
                    dispatcher.handle_close()
                except OSError:
                    pass
