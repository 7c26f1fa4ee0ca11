"""Where the pack finds its server, its key, its default model and the `gmlx` command
(docs/contract.md §7.1).

Pure: reads the environment, the settings file and (for discovery) the `gmlx` command line;
imports neither ComfyUI nor torch, so it is tested on its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gmlx_contract.client import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT_S

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
SETTINGS_ENV = "GMLX_COMFY_SETTINGS"
BASE_URL_ENV = "GMLX_BASE_URL"
API_KEY_ENV = "GMLX_API_KEY"
DEFAULT_MODEL_ENV = "GMLX_DEFAULT_IMAGE_MODEL"
COMMAND_ENV = "GMLX_COMMAND"
# How long a request to the server may wait for its answer (a step, an encode, a model's load).
TIMEOUT_ENV = "GMLX_REQUEST_TIMEOUT_S"
TIMEOUT_KEY = "request_timeout_s"
# The settings file's record of the last model list a server gave (see `remember_models`).
MODELS_SEEN_KEY = "models_seen"
# What `gmlx serve` imports beyond the pack's needs (the distribution's `server` extra).
SERVER_MODULES = ("falcon", "waitress", "mlx")
# How long a `gmlx ... --json` discovery call may take before the pack gives up on it.
CLI_TIMEOUT_S = 5.0


def settings_path(environ: dict[str, str] | None = None) -> Path:
    """The settings file: `GMLX_COMFY_SETTINGS`, else ~/.config/gmlx/comfyui.json."""
    env = os.environ if environ is None else environ
    named = env.get(SETTINGS_ENV, "").strip()
    if named:
        return Path(named).expanduser()
    return Path("~/.config/gmlx/comfyui.json").expanduser()


def read_settings(path: Path) -> dict[str, Any]:
    """The settings file as a dict; {} when it is absent or not a JSON object.

    A broken file must not stop ComfyUI from loading the pack, so it reads as empty.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def write_settings(path: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """Merge `updates` into the settings file (creating it) and return the new document."""
    doc = read_settings(path)
    doc.update(updates)
    replace_settings(path, doc)
    return doc


def replace_settings(path: Path, doc: dict[str, Any]) -> None:
    """Write `doc` as the settings file: to a temporary file that then replaces the old one,
    so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)


def _text(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def _command_words(value: Any) -> list[str]:
    """A configured command: a list of words, or one string split as a shell would."""
    if isinstance(value, list) and value and all(isinstance(w, str) and w for w in value):
        return list(value)
    return shlex.split(value) if _text(value) else []


@dataclass(frozen=True)
class Settings:
    """What the environment and the settings file say; node widgets override `base_url`."""

    base_url: str  # "" when nothing names one explicitly
    api_key: str | None
    default_model: str  # "" when nothing names one: the server's default comes first
    path: Path
    command: tuple[str, ...] = ()  # the configured `gmlx` command; () to look for one
    timeout_s: float = DEFAULT_TIMEOUT_S  # how long a request waits for its answer

    @property
    def timeout_hint(self) -> str:
        """How the user gives the server's answers longer, for a request that ran out of time."""
        return (
            f"to wait longer than {self.timeout_s:g} s, set {TIMEOUT_KEY} in {self.path} or"
            f" {TIMEOUT_ENV}"
        )

    @property
    def server_log(self) -> Path:
        """Where a server the pack starts writes its log: beside the settings file."""
        return self.path.parent / "server.log"

    def explicit_url(self, widget_url: str = "") -> str:
        """The URL the widget, the environment or the file names, unless it is the default
        one ("" then: discovery may find the configured server)."""
        explicit = normalise_url(_text(widget_url) or self.base_url)
        return explicit if explicit != DEFAULT_BASE_URL else ""

    def gmlx_command(self, serve: bool = False) -> list[str] | None:
        """The `gmlx` command: the configured one, else the `gmlx` beside this Python (the
        one installed with the pack into ComfyUI's environment), else the one on PATH. To
        `serve`, the one on PATH comes first when this Python lacks the server's packages
        (`install` puts only the pack's needs into ComfyUI's Python)."""
        if self.command:
            return list(self.command)
        folder = Path(sys.executable).parent
        beside = next((folder / n for n in ("gmlx", "gmlx.exe") if (folder / n).is_file()), None)
        on_path = shutil.which("gmlx")
        if serve and on_path and not server_installed_here():
            return [on_path]
        if beside is not None:
            return [str(beside)]
        return [on_path] if on_path else None

    def where_gmlx_is_looked_for(self) -> str:
        """The places `gmlx_command` looks, for an error that finds none."""
        return f"{COMMAND_ENV}, gmlx_command in {self.path}, {Path(sys.executable).parent}, PATH"

    def run_gmlx_json(self, args: list[str], timeout: float = CLI_TIMEOUT_S) -> Any:
        """Run `gmlx <args>` and parse its stdout as JSON; None when gmlx is absent or fails."""
        command = self.gmlx_command()
        if command is None:
            return None
        try:
            done = subprocess.run(
                [*command, *args], capture_output=True, timeout=timeout, text=True, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode != 0:
            return None
        try:
            return json.loads(done.stdout)
        except ValueError:
            return None

    def discover(self) -> Discovered | None:
        """Where `gmlx status --json` says a server is, and where the configured one is; None
        where no `gmlx` answers it (none found, it failed, or it took too long)."""
        answer = self.run_gmlx_json(["status", "--json"])
        return None if answer is None else discovered(answer)

    def configured_models(self) -> list[str]:
        """The models the server's configuration names (`gmlx list --image --json`)."""
        return model_names_from_answer(self.run_gmlx_json(["list", "--image", "--json"]) or [])

    def remembered_models(self) -> list[str]:
        """The last model list a server gave (`remember_models`), [] when none is recorded."""
        seen = read_settings(self.path).get(MODELS_SEEN_KEY)
        return model_names_from_answer(seen.get("models", [])) if isinstance(seen, dict) else []

    def remember_models(self, url: str, names: list[str]) -> None:
        """Record a server's model list (default first) in the settings file, so the loaders
        still offer it while the server is down; written only when it changed."""
        record = {"url": url, "models": list(names)}
        if read_settings(self.path).get(MODELS_SEEN_KEY) != record:
            try:
                write_settings(self.path, {MODELS_SEEN_KEY: record})
            except OSError:
                pass  # a read-only settings folder only costs the memory of the list


def server_installed_here() -> bool:
    """Whether this Python has the packages `gmlx serve` needs."""
    return all(importlib.util.find_spec(name) is not None for name in SERVER_MODULES)


@dataclass(frozen=True)
class Discovered:
    """What `gmlx status --json` said: the URL a server answers at (`url`: the configured
    server's, or that of a `gmlx serve` of this user started elsewhere), and the configured
    server's URL (`configured`; the same as `url` from a gmlx that does not say it). "" where
    it names none."""

    url: str = ""
    configured: str = ""


def discovered(status_doc: Any) -> Discovered:
    url = discovered_url(status_doc)
    if isinstance(status_doc, dict) and "configured_url" in status_doc:
        return Discovered(url, _text(status_doc["configured_url"]))
    return Discovered(url, url)


def candidate_urls(explicit: str, found: Discovered = Discovered()) -> list[str]:
    """The URLs to try in order (docs/contract.md §7.1, §7.2): an explicit URL alone (see
    `Settings.explicit_url`); else the discovered one (`gmlx status --json`), the configured
    one where that differs, then the default."""
    if explicit:
        return [explicit]
    urls: list[str] = []
    for url in (found.url, found.configured, DEFAULT_BASE_URL):
        url = normalise_url(url)
        if url and url not in urls:
            urls.append(url)
    return urls


def discovered_url(status_doc: Any) -> str:
    """The server URL in a `gmlx status --json` answer ("" when it names none)."""
    if not isinstance(status_doc, dict):
        return ""
    for key in ("url", "base_url"):
        url = _text(status_doc.get(key))
        if url:
            return url
    server = status_doc.get("server")
    if isinstance(server, dict):
        return discovered_url(server)
    return ""


def normalise_url(url: str) -> str:
    """Strip whitespace and trailing slashes; add http:// when no scheme is given."""
    url = url.strip().rstrip("/")
    if url and "://" not in url:
        url = "http://" + url
    return url


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    """Resolve the settings from the environment and the settings file (docs/contract.md §7.1)."""
    env = os.environ if environ is None else environ
    path = settings_path(env)
    doc = read_settings(path)
    base_url = _text(env.get(BASE_URL_ENV)) or _text(doc.get("base_url"))
    api_key = _text(env.get(API_KEY_ENV)) or _text(doc.get("api_key")) or None
    default_model = _text(env.get(DEFAULT_MODEL_ENV)) or _text(doc.get("default_model"))
    command = _command_words(env.get(COMMAND_ENV)) or _command_words(doc.get("gmlx_command"))
    return Settings(
        base_url=base_url,
        api_key=api_key,
        default_model=default_model,
        path=path,
        command=tuple(command),
        timeout_s=_seconds(env.get(TIMEOUT_ENV))
        or _seconds(doc.get(TIMEOUT_KEY))
        or DEFAULT_TIMEOUT_S,
    )


def _seconds(value: Any) -> float | None:
    """A positive, finite number of seconds (a number or its text), else None: a mistyped
    setting falls back on the default rather than stop ComfyUI from loading the pack."""
    if value is None or isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if 0 < seconds < float("inf") else None


def model_names_from_answer(doc: Any) -> list[str]:
    """Model ids from a `GET models` answer (or `gmlx list --image --json`), default first."""
    if isinstance(doc, dict):
        entries = doc.get("models", [])
        default = doc.get("default_model")
    else:
        entries, default = doc, None
    names: list[str] = []
    for entry in entries if isinstance(entries, list) else []:
        name = entry.get("model", entry.get("id")) if isinstance(entry, dict) else entry
        if isinstance(name, str) and name and name not in names:
            names.append(name)
    if isinstance(default, str) and default in names:
        names.remove(default)
        names.insert(0, default)
    return names
