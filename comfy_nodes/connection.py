"""One connection per server: the handshake, the model list and the shared step client.

The CLIP, VAE and MODEL of one server share a `Connection`, so that what an encode stored on
the server counts as known to the steps, and adapters go up once. Imports neither ComfyUI nor
torch.
"""

from __future__ import annotations

import atexit
import logging
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
from gmlx_contract.client import StepClient
from gmlx_contract.errors import NotGmlxServer, StepError
from gmlx_contract.wire import GiB

from .errors import GmlxError
from .interrupts import COMFY_INTERRUPT, InterruptFlag, call_or_interrupt
from .settings import (
    DEFAULT_BASE_URL,
    Discovered,
    Settings,
    candidate_urls,
    load_settings,
    model_names_from_answer,
    normalise_url,
)

T = TypeVar("T")
log = logging.getLogger("gmlx_comfy")

MODEL_LIST_TTL_S = 10.0
MODEL_PROBE_TIMEOUT_S = 1.0
# How long the configured server's URL (`gmlx status --json`) is reused.
DISCOVERY_TTL_S = 30.0
# A discovery this recent is not asked again before a start.
FRESH_S = 1.0
START_WAIT_S = 180.0
# How often the wait for a freshly started server polls /health.
START_POLL_S = 1.0
# What a started server that lacks the server's packages is told to do.
MISSING_SERVER_FIX = (
    "; this `gmlx` lacks the server's packages: run `gmlx comfyui install` again from the"
    " environment that has them (it records its own `gmlx` as the settings file's"
    " gmlx_command), or set GMLX_COMMAND to that `gmlx`"
)
# How many of its log's last lines the error quotes when a started server exits.
LOG_TAIL_LINES = 4
# How long a started server gets to stop (SIGTERM) when ComfyUI exits, before it is killed.
STOP_WAIT_S = 10.0


@dataclass
class Connection:
    """A handshaken server: its client, capabilities and per-model status documents."""

    url: str
    api_key: str | None
    client: StepClient
    capabilities: dict[str, Any]
    # Serialises use of `client` (one keep-alive session) between ComfyUI's thread and the
    # worker thread a step runs on.
    lock: threading.RLock = field(default_factory=threading.RLock)
    # Adapter hashes uploaded or found on the server through this connection.
    adapters_held: set[str] = field(default_factory=set)
    # How to connect again when the server has gone (`connect` with the loaders' settings;
    # None: the loaders said not to start one), and how often it has (what was put on the
    # server before, patch tables, is gone with it).
    revive: Any = None
    generation: int = 0

    @property
    def features(self) -> set[str]:
        return set(self.capabilities.get("features") or [])

    def ensure_reachable(self) -> None:
        """Where the server no longer answers since the loaders connected (ComfyUI does not run
        cached loaders again), connect again, starting it as the loaders' start_server says;
        else say so, naming what to do."""
        if self.client.health():
            return
        if self.revive is None:
            raise GmlxError(
                f"gmlx: the server at {self.url} no longer answers; start it again (`gmlx"
                " serve`), or switch on the loader's start_server"
            )
        log.warning("gmlx: the server at %s no longer answers; connecting again", self.url)
        found = self.revive()
        if found is not self:  # another address: the configured server, or one started since
            self._move_to(found)
        self.adapters_held.clear()
        self.generation += 1

    def _move_to(self, other: Connection) -> None:
        """Speak to `other`'s server from now on (the loaders' CLIP, VAE and MODEL hold this
        object): its address, client, capabilities and the lock over that client; this object
        no longer stands for its old address."""
        with _connections_lock:
            for key in [key for key, conn in _connections.items() if conn is self]:
                del _connections[key]
        log.info("gmlx: now connected to the server at %s", other.url)
        self.url, self.client, self.lock = other.url, other.client, other.lock
        self.capabilities = other.capabilities

    def call(self, work: Callable[[], T], on_cancel: Callable[[], None] = lambda: None) -> T:
        """`work()` with this connection's client to itself (one call at a time), given up on
        at ComfyUI's interrupt (`on_cancel` then runs; interrupts.call_or_interrupt)."""
        return call_or_interrupt(work, COMFY_INTERRUPT, on_cancel, lock=self.lock)

    def control_client(self, timeout: float | None = None) -> StepClient:
        """A separate client (own session) for the calls of runs: interrupts and run ends must
        not wait for a step's connection, nor other calls for a run's begin (which may load a
        model for minutes, and go on after its prompt was cancelled). `timeout`: the call's own
        bound; None: the request timeout setting's, and its hint where it runs out."""
        if timeout is None:
            return StepClient(self.url, self.api_key, self.client.timeout, self.client.timeout_hint)
        return StepClient(self.url, self.api_key, timeout)

    def ensure_adapters(self, adapters: Mapping[str, np.ndarray]) -> None:
        """Put each adapter matrix (by hash) on the server unless this connection already did:
        the client HEADs and PUTs if absent (docs/contract.md §7.7). A set larger than the
        server's adapter cache is refused first: its table could never be defined, the cache
        dropping the first matrices to hold the last."""
        total = sum(int(array.nbytes) for array in adapters.values())
        room = adapter_cache_bytes(self.capabilities)
        if room is not None and total > room:
            with self.lock:  # the bound follows the models loaded: ask again before refusing
                room = adapter_cache_bytes(self.client.capabilities())
        if room is not None and total > room:
            raise GmlxError(
                f"gmlx: the LoRA patches' matrices take {total / 2**20:.1f} MiB, more than the"
                f" server's adapter cache holds ({room / 2**20:.1f} MiB); raise"
                " server.image.adapter_cache_mb in the server's config, or load fewer LoRAs"
            )
        with self.lock:
            for digest, array in adapters.items():
                if digest in self.adapters_held:
                    continue
                held = self.client.ensure_adapter(array)
                if held != digest:
                    raise GmlxError(f"gmlx: the adapter named {digest} hashes to {held}")
                self.adapters_held.add(digest)

    def require_model(self, model_id: str, remember: bool = True) -> None:
        """Refuse a model the server does not list, saying what it lists and how a model is
        added; with `remember`, the list is remembered for the loaders' list while the server
        is down (`Settings.remember_models`): the found server's, not one a loader names."""
        with self.lock:
            names = model_names_from_answer(self.client.models())
        if remember:
            load_settings().remember_models(self.url, names)
        if model_id not in names:
            listed = ", ".join(names) if names else "no models"
            raise GmlxError(
                f"gmlx: the server at {self.url} has no image model {model_id!r} (it lists "
                f"{listed}); pick one it lists, fetch a published model on the server's machine "
                "(`gmlx pull NAME`; `gmlx pull --list` names them), or put the model's folder "
                "(holding its model_index.json) into one of the server's model_dirs (`gmlx list` "
                "shows them)"
            )


def adapter_cache_bytes(capabilities: dict) -> int | None:
    """The adapter cache's bound where the capabilities tell it: `max_adapter_bytes` is
    min(1 GiB, the bound) (docs/contract.md §2.1), so below 1 GiB it is the bound; else None."""
    limit = (capabilities.get("limits") or {}).get("max_adapter_bytes")
    return limit if isinstance(limit, int) and limit < GiB else None


class RemotePart:
    """A part of a server's model that ComfyUI holds (the remote CLIP, the remote VAE): its
    calls take the connection's client one at a time, and are given up on at the interrupt
    (`call`)."""

    interrupt: InterruptFlag = COMFY_INTERRUPT  # ComfyUI's; a test sets its own

    def __init__(self, conn: Connection, model_id: str) -> None:
        self.conn = conn
        self.model_id = model_id

    def call(self, work: Callable[[], T]) -> T:
        """`work()` with the connection's client to itself, abandoned at an interrupt."""
        return call_or_interrupt(work, self.interrupt, lock=self.conn.lock)


_connections: dict[tuple[str, str | None], Connection] = {}
_connections_lock = threading.Lock()


def connect(widget_url: str = "", start_server: bool = True, settings: Settings | None = None):
    """Handshake with the server the settings name (docs/contract.md §7.2) and return its Connection.

    Tries each candidate URL in order; a non-gmlx answer moves on, a version mismatch stops.
    With none answering and `start_server`, starts `gmlx serve` where it was looked for
    (`StartedServer`) and waits for it.
    """
    settings = settings or load_settings()
    conn = _connect(settings, widget_url, start_server)
    conn.revive = (lambda: _connect(settings, widget_url, True)) if start_server else None
    return conn


def _connect(settings: Settings, widget_url: str, start_server: bool) -> Connection:
    explicit = settings.explicit_url(widget_url)
    found = Discovered() if explicit else _discovered(settings)
    failures: list[NotGmlxServer] = []
    conn = _first_answering(candidate_urls(explicit, found), settings, failures)
    if conn is None and start_server and not explicit:
        # A server started since the discovery the loaders share: ask once more before
        # starting one (a start costs a model's memory; the question, a fraction of a second).
        fresh = _discovered(settings, fresh=True)
        if fresh is not None and fresh != found:
            found, failures = fresh, []
            conn = _first_answering(candidate_urls("", found), settings, failures)
    if conn is not None:
        return conn
    unanswered = "no gmlx server answers at " + " or at ".join(
        f"{f.url} ({f.reason})" for f in failures
    )
    if not start_server:
        raise GmlxError(
            f"gmlx: {unanswered}; start one with `gmlx serve`, or switch on start_server"
        )
    # The configured server starts as configured (also where a server found elsewhere no
    # longer answers); any other URL is served by `gmlx serve --host --port` of that URL.
    url = explicit or normalise_url(found.configured) or DEFAULT_BASE_URL
    flags = [] if url == normalise_url(found.configured) else serve_flags(url, unanswered)
    server = StartedServer.get_or_start(url, flags, settings, unanswered)
    return server.wait(lambda: _try(url, settings, []), settings.api_key)


def _first_answering(urls: list[str], settings: Settings, failures: list) -> Connection | None:
    for url in urls:
        conn = _try(url, settings, failures)
        if conn is not None:
            return conn
    return None


def _discovered(settings: Settings, fresh: bool = False) -> Discovered | None:
    """`settings.discover()` (a `gmlx status --json` subprocess), reused for DISCOVERY_TTL_S
    so that the loaders of one prompt run it once. `fresh`: asked again, unless it was asked
    within FRESH_S; None where that answer failed (what was kept is then kept)."""
    key = tuple(settings.gmlx_command() or ())
    with _discovery_lock:
        cached = _discovery.get(key)
    age = time.monotonic() - cached[0] if cached is not None else None
    if age is not None and age < (FRESH_S if fresh else DISCOVERY_TTL_S):
        return cached[1]
    found = settings.discover()
    if found is None:  # no gmlx, or its answer failed or came too late
        return None if fresh else Discovered()
    with _discovery_lock:
        _discovery[key] = (time.monotonic(), found)
    return found


_discovery: dict[tuple[str, ...], tuple[float, Discovered]] = {}
_discovery_lock = threading.Lock()


def _try(url: str, settings: Settings, failures: list[NotGmlxServer]) -> Connection | None:
    api_key = settings.api_key
    key = (url, api_key)
    with _connections_lock:
        conn = _connections.get(key)
    if conn is not None:
        client = conn.client
    else:
        client = StepClient(url, api_key, settings.timeout_s, settings.timeout_hint)
    try:
        if conn is not None:
            with conn.lock:
                client.set_timeout(settings.timeout_s, settings.timeout_hint)  # as set now
                caps = client.handshake()
        else:
            caps = client.handshake()
    except NotGmlxServer as err:
        failures.append(err)
        return None
    except StepError as err:  # a version mismatch, 401/403 and the like: the user has to act
        raise GmlxError(str(err)) from err
    if conn is None:
        conn = Connection(url=url, api_key=api_key, client=client, capabilities=caps)
        with _connections_lock:
            conn = _connections.setdefault(key, conn)
    conn.capabilities = caps
    return conn


def serve_flags(url: str, unanswered: str) -> list[str]:
    """`gmlx serve` flags that serve at `url`: it must be plain http://host[:port]."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise GmlxError(
            f"gmlx: {unanswered}, and start_server starts a server only at a plain "
            "http://host:port address; start the server for that address yourself"
        )
    if not listenable_here(parts.hostname):
        raise GmlxError(
            f"gmlx: {unanswered}; {parts.hostname} is not an address of this machine, so"
            " start_server cannot start a server there: start `gmlx serve` on that machine"
        )
    return ["--host", parts.hostname, "--port", str(parts.port or 80)]


def listenable_here(host: str) -> bool:
    """Whether this machine can listen at `host`: one of its own addresses (a loopback one,
    the wildcard, or an interface's), found by binding a probe socket there."""
    try:
        addresses = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:  # no such name
        return False
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(address[:2] if family == socket.AF_INET else address)
            return True
        except OSError:
            continue
    return False


@dataclass
class StartedServer:
    """A `gmlx serve` the pack started: its process, command and log. It is stopped when
    ComfyUI exits (`stop_started_servers`, run at exit); one killed outright leaves it running."""

    url: str
    command: list[str]
    process: subprocess.Popen
    log_path: Path
    log_offset: int  # where this start's lines begin in the log
    started_at: float

    @classmethod
    def get_or_start(
        cls, url: str, flags: list[str], settings: Settings, unanswered: str
    ) -> StartedServer:
        """The server already started for `url` while it runs, else a new one."""
        with _started_lock:
            running = _started.get(url)
            if running is not None and running.process.poll() is None:
                return running
            server = cls.start(url, flags, settings, unanswered)
            _started[url] = server
            return server

    @classmethod
    def start(
        cls, url: str, flags: list[str], settings: Settings, unanswered: str
    ) -> StartedServer:
        gmlx = settings.gmlx_command(serve=True)
        if gmlx is None:
            raise GmlxError(
                f"gmlx: {unanswered}, and no `gmlx` command was found to start one (looked at "
                f"{settings.where_gmlx_is_looked_for()}); install the server there "
                "(`pip install 'gmlx-steps[server]'`) or name its command in gmlx_command"
            )
        command = [*gmlx, "serve", *flags]
        log_path = settings.server_log
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            offset = log_file.tell()
            log_file.write(f"---- {time.ctime()}: {shlex.join(command)}\n".encode())
            log_file.flush()
            try:
                process = subprocess.Popen(  # noqa: S603 - a configured or found gmlx, no shell
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            except OSError as error:
                raise GmlxError(
                    f"gmlx: {unanswered}, and `{shlex.join(command)}` cannot run to start one "
                    f"({error.strerror or error}); name a working command in gmlx_command"
                ) from error
        _stop_at_exit()
        log.info(
            "gmlx: %s; started `%s` (pid %d), waiting up to %.0f s for it (log: %s)",
            unanswered,
            shlex.join(command),
            process.pid,
            START_WAIT_S,
            log_path,
        )
        return cls(url, command, process, log_path, offset, time.monotonic())

    def wait(self, handshake, api_key: str | None) -> Connection:
        """Poll /health until the server answers, then `handshake()`; stop early with its log's
        last lines when the process exits."""
        probe = StepClient(self.url, api_key)
        deadline = time.monotonic() + START_WAIT_S  # a later loader waits its own while
        try:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    tail = self.log_tail()
                    raise GmlxError(
                        f"gmlx: `{shlex.join(self.command)}` exited with status {code} before "
                        f"answering at {self.url}; the end of its log {self.log_path}: {tail}"
                        + (MISSING_SERVER_FIX if "No module named" in tail else "")
                    )
                if probe.health():
                    conn = handshake()
                    if conn is not None:
                        elapsed = time.monotonic() - self.started_at
                        log.info("gmlx: the server at %s answers (%.1f s)", self.url, elapsed)
                        return conn
                time.sleep(START_POLL_S)
        finally:
            probe.close()
        raise GmlxError(
            f"gmlx: `{shlex.join(self.command)}` (pid {self.process.pid}) did not answer at "
            f"{self.url} within {START_WAIT_S:.0f} s and still runs; the end of its log "
            f"{self.log_path}: {self.log_tail()}"
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines this start wrote to the log, joined on one line."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self.log_offset)
                text = log_file.read().decode("utf-8", errors="replace")
        except OSError as error:
            return f"(unreadable: {error.strerror})"
        kept = [line.strip() for line in text.splitlines()[1:] if line.strip()]
        return " | ".join(kept[-lines:]) or "(empty)"

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_started: dict[str, StartedServer] = {}
_started_lock = threading.Lock()
_stop_registered = threading.Event()


def _stop_at_exit() -> None:
    if not _stop_registered.is_set():
        _stop_registered.set()
        atexit.register(stop_started_servers)


def stop_started_servers() -> None:
    """Stop every server this process started (SIGTERM: it ends its runs and lets its models
    go; killed after STOP_WAIT_S)."""
    with _started_lock:
        servers = list(_started.values())
        _started.clear()
    for server in servers:
        server.stop()


class ModelList:
    """The loaders' model list (docs/contract.md §7.1): what the server lists (a quick
    `GET models`), else what a server listed last (the settings file), else what the server's
    configuration names (`gmlx list --image --json`); kept 10 s."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._at = -MODEL_LIST_TTL_S
        self._lock = threading.Lock()

    def names(self, settings: Settings | None = None) -> list[str]:
        with self._lock:
            if time.monotonic() - self._at < MODEL_LIST_TTL_S and self._names:
                return list(self._names)
            settings = settings or load_settings()
            names = (
                self._probe(settings)
                or settings.remembered_models()
                or settings.configured_models()
            )
            self._names, self._at = names, time.monotonic()
            return list(names)

    @staticmethod
    def _probe(settings: Settings) -> list[str]:
        """The model list of the first server that answers where `connect` looks: the explicit
        URL alone, else where the server's configuration puts it (`gmlx status --json`, reused
        for DISCOVERY_TTL_S), then the default URL."""
        explicit = settings.explicit_url()
        found = Discovered() if explicit else _discovered(settings)
        for url in candidate_urls(explicit, found):
            with StepClient(url, settings.api_key, timeout=MODEL_PROBE_TIMEOUT_S) as client:
                if not client.health():
                    continue
                try:
                    names = model_names_from_answer(client.models())
                except StepError:
                    continue
            if names:
                settings.remember_models(url, names)
                return names
        return []


MODEL_LIST = ModelList()
