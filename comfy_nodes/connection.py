"""One connection per server: the handshake, the model list and the shared step client.

The CLIP, VAE and MODEL of one server share a `Connection`, so that what an encode stored on
the server counts as known to the steps, and adapters go up once. Imports neither ComfyUI nor
torch.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gmlx_contract.client import StepClient
from gmlx_contract.errors import ContractMismatch, NotGmlxServer, StepError

from .errors import GmlxError
from .settings import (
    Settings,
    load_settings,
    model_names_from_answer,
    normalise_url,
    run_gmlx_json,
)

log = logging.getLogger("gmlx_comfy")

MODEL_LIST_TTL_S = 10.0
MODEL_PROBE_TIMEOUT_S = 1.0
START_WAIT_S = 180.0
# How often the wait for a freshly started server polls /health.
START_POLL_S = 1.0


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

    @property
    def features(self) -> set[str]:
        return set(self.capabilities.get("features") or [])

    def control_client(self, timeout: float) -> StepClient:
        """A separate client (own session) for calls made while a step is in flight:
        interrupts and run ends must not wait for the step's connection."""
        return StepClient(self.url, self.api_key, timeout=timeout)

    def ensure_adapters(self, adapters: Mapping[str, np.ndarray]) -> None:
        """Put each adapter matrix (by hash) on the server unless this connection already did:
        the client HEADs and PUTs if absent (docs/contract.md §7.7)."""
        with self.lock:
            for digest, array in adapters.items():
                if digest in self.adapters_held:
                    continue
                held = self.client.ensure_adapter(array)
                if held != digest:
                    raise GmlxError(f"gmlx: the adapter named {digest} hashes to {held}")
                self.adapters_held.add(digest)

    def require_model(self, model_id: str) -> None:
        """Refuse a model the server does not list, suggesting the matching `gmlx pull`."""
        with self.lock:
            names = model_names_from_answer(self.client.models())
        if model_id not in names:
            listed = ", ".join(names) if names else "none"
            raise GmlxError(
                f"gmlx: the server at {self.url} has no image model {model_id!r} (it lists "
                f"{listed}); fetch it with `gmlx pull {model_id}` and restart the server"
            )


_connections: dict[tuple[str, str | None], Connection] = {}
_connections_lock = threading.Lock()


def connect(widget_url: str = "", start_server: bool = True, settings: Settings | None = None):
    """Handshake with the server the settings name (docs/contract.md §7.2) and return its Connection.

    Tries each candidate URL in order; a non-gmlx answer moves on, a version mismatch stops.
    With none answering and `start_server`, runs `gmlx serve` and waits for it.
    """
    settings = settings or load_settings()
    urls = settings.candidate_urls(widget_url)
    failures: list[str] = []
    for url in urls:
        conn = _try(url, settings.api_key, failures)
        if conn is not None:
            return conn
    if start_server:
        url = urls[-1]
        _start_server(url)
        conn = _wait_for(url, settings.api_key, failures)
        if conn is not None:
            return conn
    tried = "; ".join(failures) or ", ".join(urls)
    hint = "" if start_server else " (start it with `gmlx serve`, or set start_server)"
    raise GmlxError(f"gmlx: no gmlx image server answers: {tried}{hint}")


def _try(url: str, api_key: str | None, failures: list[str]) -> Connection | None:
    key = (url, api_key)
    with _connections_lock:
        conn = _connections.get(key)
    client = conn.client if conn is not None else StepClient(url, api_key)
    try:
        if conn is not None:
            with conn.lock:
                caps = client.handshake()
        else:
            caps = client.handshake()
    except ContractMismatch as err:
        raise GmlxError(str(err)) from err
    except NotGmlxServer as err:
        failures.append(str(err))
        return None
    except StepError as err:  # 401/403 and the like: the user has to act
        raise GmlxError(str(err)) from err
    if conn is None:
        conn = Connection(url=url, api_key=api_key, client=client, capabilities=caps)
        with _connections_lock:
            conn = _connections.setdefault(key, conn)
    conn.capabilities = caps
    return conn


def _start_server(url: str) -> None:
    exe = shutil.which("gmlx")
    if exe is None:
        raise GmlxError(
            f"gmlx: no server answers at {url} and the `gmlx` command is not on PATH to start one"
        )
    log.info("gmlx: starting `gmlx serve` for %s", url)
    subprocess.Popen(  # noqa: S603 - our own command, no shell
        [exe, "serve"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _wait_for(url: str, api_key: str | None, failures: list[str]) -> Connection | None:
    probe = StepClient(url, api_key)
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        if probe.health():
            return _try(url, api_key, failures)
        time.sleep(START_POLL_S)
    failures.append(f"`gmlx serve` did not answer at {url} within {START_WAIT_S:.0f} s")
    return None


class ModelList:
    """The loaders' model list (docs/contract.md §7.1): a quick `GET models` probe, else
    `gmlx list --image --json`, else the default name; kept 10 s. Names seen once stay listed
    so a saved workflow still validates while the server is down."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._at = -MODEL_LIST_TTL_S
        self._lock = threading.Lock()

    def names(self, settings: Settings | None = None) -> list[str]:
        with self._lock:
            if time.monotonic() - self._at < MODEL_LIST_TTL_S and self._names:
                return list(self._names)
            settings = settings or load_settings()
            fresh = self._probe(settings) or [settings.default_model]
            merged = fresh + [n for n in self._names if n not in fresh]
            self._names, self._at = merged, time.monotonic()
            return list(merged)

    @staticmethod
    def _probe(settings: Settings) -> list[str]:
        for url in _probe_urls(settings):
            client = StepClient(url, settings.api_key, timeout=MODEL_PROBE_TIMEOUT_S)
            try:
                names = model_names_from_answer(client.models())
            except (StepError, OSError, ValueError):
                continue
            finally:
                client.close()
            if names:
                return names
        return model_names_from_answer(run_gmlx_json(["list", "--image", "--json"]) or [])


def _probe_urls(settings: Settings) -> list[str]:
    # Discovery runs a subprocess; the quick probe only tries the configured or default URL.
    return [normalise_url(u) for u in settings.candidate_urls("", discover=lambda: "")]


MODEL_LIST = ModelList()
