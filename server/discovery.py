"""`gmlx status` and `gmlx list`: where the configured server is and which models its
configuration names, for people and for clients that look before they connect (the ComfyUI
pack runs `gmlx status --json` and `gmlx list --image --json`, docs/contract.md §7.1).

Both read the same configuration `gmlx serve` reads (server/config.py) and import neither MLX
nor the HTTP server, so they answer in a fraction of a second wherever gmlx-steps is installed.
Both exit 0 when the configuration reads (what they found is in the answer), 2 when it does not.
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import __version__
from .config import ConfigError, ServerConfig, load_config
from .server_records import running_servers

# How long `gmlx status` waits for the resident models' status, all of them together: a
# loaded model's status waits for the image worker, which a long step may hold, and the ComfyUI
# pack gives `gmlx status --json` 5 s before it looks for a server without it.
RESIDENCY_WAIT_S = 2.0
# How long `gmlx status` waits for a connection where no server answered, to tell a port
# something else holds (or a stuck server) from a free one.
LISTEN_PROBE_S = 0.5
# Addresses a server listens on that a client cannot connect to: the loopback one of that kind.
WILDCARD_HOSTS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def register(subparsers) -> None:
    status = subparsers.add_parser(
        "status", help="whether the configured gmlx server answers, and where"
    )
    _common_arguments(status)
    status.add_argument("--host", default=None, help="ask there, as `gmlx serve --host` serves")
    status.add_argument("--port", type=int, default=None, help="ask there, as `gmlx serve --port`")
    status.set_defaults(func=status_command)
    listing = subparsers.add_parser(
        "list",
        aliases=["models"],
        help="the models the configuration names (model_dirs, [models], the default; the"
        " embedded models where no default is set, else the one it names)",
    )
    listing.add_argument(
        "--image",
        action="store_true",
        help="image models only (every model gmlx-steps serves is one)",
    )
    _common_arguments(listing)
    listing.set_defaults(func=list_command)


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="TOML config file")
    parser.add_argument("--json", action="store_true", help="answer as one JSON object")


def server_url(config: ServerConfig) -> str | None:
    """The URL a client on this machine reaches the configured server at (None for port 0,
    which the server picks when it starts)."""
    return None if config.port == 0 else client_url(config.host, config.port)


def client_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a server listening on host:port at."""
    host = WILDCARD_HOSTS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def server_status(config: ServerConfig, look_elsewhere: bool = True) -> dict[str, Any]:
    """The configured server's URL, whether a compatible gmlx server answers there and, when
    one does, its resident models with what each holds (status `residency`: the DiT, the text
    encoder and the VAE, resident or released, their bytes, dtype and quantization).

    Where none answers there and `look_elsewhere`, the same of the latest started `gmlx serve`
    of this user that answers the handshake where its record says, and does not refuse it
    (server_records: one started on another port or with another config file); `record` then
    holds its pid, config file and start. `listening`: whether something takes connections at
    `url`, though it may answer no handshake (a stuck process, another program)."""
    url = server_url(config)
    doc: dict[str, Any] = {
        "url": url,
        "configured_url": url,
        "config": str(config.source) if config.source else None,
        "running": False,
        "gmlx_version": None,
        "contract": None,
        "error": None,
        "resident": [],
        "record": None,
        "listening": False,
    }
    if url is None:
        doc["error"] = "the configured port is 0: the server picks its port when it starts"
    else:
        doc.update(_answer(url, config.api_key))
        doc["listening"] = doc["running"] or _listening(url)
    if doc["running"] or not look_elsewhere:
        return doc
    for record in running_servers():
        if record["url"] == url:
            continue
        answer = _answer(record["url"], config.api_key)
        if answer["running"] and answer["error"] is None:  # not one that refuses this client
            found = {key: record.get(key) for key in ("pid", "config", "started")}
            return {**doc, **answer, "url": record["url"], "record": found, "listening": True}
    return doc


def _listening(url: str) -> bool:
    """Whether a connection to `url`'s host and port is taken (LISTEN_PROBE_S at most)."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=LISTEN_PROBE_S):
            return True
    except OSError:
        return False


def _answer(url: str, api_key: str | None) -> dict[str, Any]:
    """What the server at `url` answers: whether it runs and, when it answers the handshake,
    its version, contract and resident models; `error` when none answers or it refuses."""
    from gmlx_contract.client import StepClient
    from gmlx_contract.errors import NotGmlxServer, StepError

    with StepClient(url, api_key) as client:
        try:
            caps = client.handshake()
        except NotGmlxServer as error:
            return {"running": False, "error": error.reason}
        except StepError as error:  # it answers, but refuses or speaks another contract
            return {"running": True, "error": str(error)}
    contract = caps.get("contract") or {}
    return {
        "running": True,
        "error": None,
        "gmlx_version": caps.get("gmlx_version"),
        "contract": f"{contract.get('major')}.{contract.get('minor')}",
        "resident": _residents(url, api_key),
    }


def _residents(url: str, api_key: str | None) -> list[dict[str, Any]]:
    """Each resident model's id and status `residency` (null where the server has none, or
    where it did not answer within RESIDENCY_WAIT_S of the first ask: a loaded model's status
    waits for the image worker, which a long step may hold)."""
    from gmlx_contract.client import StepClient
    from gmlx_contract.errors import StepError

    deadline = time.monotonic() + RESIDENCY_WAIT_S
    with StepClient(url, api_key, timeout=RESIDENCY_WAIT_S) as client:
        try:
            listed = [e["model"] for e in client.models().get("models", []) if e.get("resident")]
        except StepError:
            return []
        residents = []
        for model in listed:
            residency, left = None, deadline - time.monotonic()
            if left > 0:
                client.timeout = left
                try:
                    residency = client.status(model).get("residency")
                except StepError:
                    pass
            residents.append({"model": model, "residency": residency})
    return residents


def _residency_line(resident: dict[str, Any]) -> str:
    """`model: dit f32 2.4 MB resident; encoder bf16 4-bit 1.1 MB released (auto); ...`"""
    parts = []
    for name, component in (resident["residency"] or {}).items():
        quantization = component.get("quantization")
        precision = component["dtype"] + (f" {quantization['bits']}-bit" if quantization else "")
        state = "resident" if component["resident"] else "released"
        policy = f" ({component['policy']})" if component.get("policy") else ""
        size = f"{component['bytes'] / 1e6:.1f} MB"
        parts.append(f"{name} {precision} {size} {state}{policy}")
    return f"  {resident['model']}: " + ("; ".join(parts) or "resident")


def configured_models(config: ServerConfig) -> dict[str, Any]:
    """The models `gmlx serve` with this configuration would list: each model folder under
    model_dirs, the models from component files (with their `files`), the embedded models when
    no default_model is set, else the one it names (`embedded`; their folder is made on first
    use), and the ids that
    `[models."id"]` and default_model name (with no folder when none is found); a folder no
    family reads says why (`unservable`)."""
    from .engine.registry import ModelRegistry

    sets = config.component_sets()
    registry = ModelRegistry(config.model_dirs, component_sets=lambda: sets)
    folders: dict[str, str | None] = {
        model_id: str(path) for model_id, path in registry.folders().items()
    }
    default = config.default_model
    embedded = embedded_models(default, config.model_dirs)
    if default is None:
        default = embedded[0][0] if embedded else None
    for model_id, folder in embedded:
        folders.setdefault(model_id, str(folder) if folder.is_dir() else None)
    embedded_ids = {model_id for model_id, _ in embedded}
    for model_id in [*config.models, *([default] if default else [])]:
        folders.setdefault(model_id, None)
    models = [
        {
            "model": model_id,
            "folder": folder,
            "default": model_id == default,
            "embedded": model_id in embedded_ids,
        }
        for model_id, folder in sorted(folders.items(), key=lambda item: item[0] != default)
    ]
    unservable = {
        entry.model_id: "no family this server has reads it" + registry.why_unidentified(entry)
        for entry in registry.entries()
        if entry.family is None
    }
    for model in models:  # a model from component files: its files (its folder is the cache's)
        if model["model"] in sets:
            model["files"] = {k: str(v) for k, v in sets[model["model"]].paths().items()}
        if model["model"] in unservable:
            model["unservable"] = unservable[model["model"]]
    return {
        "models": models,
        "default_model": default,
        "model_dirs": [str(d) for d in config.model_dirs],
        "config": str(config.source) if config.source else None,
    }


def embedded_models(default_model: str | None, model_dirs: list[Path]) -> list[tuple[str, Path]]:
    """The ids of the embedded models a configuration serves (every one without a
    default_model, else the one it names) and the folders `gmlx serve` generates them in on
    first use, the embedded default first; none where they cannot be made (the server's extras
    are not installed), and then a server with no default_model has no default either."""
    from .engine.registry import embedded_modules_served

    modules = embedded_modules_served(default_model, model_dirs)
    return [(module.RECIPE.name, module.RECIPE.folder()) for module in modules]


def status_command(args: argparse.Namespace) -> int:
    asked_where = args.host is not None or args.port is not None  # then there alone
    status = functools.partial(server_status, look_elsewhere=not asked_where)
    return _report(args, status, _print_status)


def list_command(args: argparse.Namespace) -> int:
    return _report(args, configured_models, _print_models)


def _report(
    args: argparse.Namespace, read: Callable[[ServerConfig], dict], show: Callable[[dict], None]
) -> int:
    """A command's document of the configured server, as JSON with --json, else in prose by
    `show`; 2 when the config cannot be read (said on stderr)."""
    config = _config(args)
    if config is None:
        return 2
    doc = read(config)
    if args.json:
        print(json.dumps(doc))
    else:
        show(doc)
    return 0


def _print_status(doc: dict) -> None:
    where = f"gmlx server {doc['url'] or '(port 0)'}"
    source = doc["config"] or "no config file (defaults)"
    if doc["running"] and not doc["error"]:
        print(f"{where}: running gmlx {doc['gmlx_version']}, contract {doc['contract']}")
        for resident in doc["resident"]:
            print(_residency_line(resident))
    elif doc["running"]:
        print(f"{where}: answers, but {doc['error']}")
    elif doc["listening"]:
        print(
            f"{where}: something listens there but answers as no gmlx server ({doc['error']});"
            " `gmlx serve` there would find the port taken"
        )
    else:
        print(f"{where}: not running ({doc['error']}); start it with `gmlx serve`")
    record = doc["record"]
    if record is not None:
        print(
            f"  (the configured server {doc['configured_url'] or '(port 0)'} does not answer;"
            f" this one is `gmlx serve` pid {record['pid']}, config"
            f" {record['config'] or 'none'})"
        )
    print(f"config: {source}; this gmlx: {__version__}")


def _print_models(doc: dict) -> None:
    for model in doc["models"]:
        mark = " (default)" if model["default"] else ""
        where = model["folder"] or (
            "made on first use"
            if model.get("embedded")
            else "no model folder of that id (a mistyped id? `gmlx pull` or a [models] entry"
            " naming its files gives one)"
        )
        if "files" in model:
            where = ", ".join(f"{k} {v}" for k, v in model["files"].items())
        unservable = f" (not servable: {model['unservable']})" if "unservable" in model else ""
        print(f"{model['model']}{mark}: {where}{unservable}")
    dirs = ", ".join(
        folder + ("" if Path(folder).is_dir() else " (no such folder: no models come from it)")
        for folder in doc["model_dirs"]
    )
    dirs = dirs or "none"
    print(f"model_dirs: {dirs}; config: {doc['config'] or 'no config file (defaults)'}")


def _config(args: argparse.Namespace) -> ServerConfig | None:
    try:
        return load_config(
            args.config, host=getattr(args, "host", None), port=getattr(args, "port", None)
        )
    except ConfigError as error:
        print(f"gmlx {args.command}: {error}", file=sys.stderr)
        return None
