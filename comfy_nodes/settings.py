"""Where the pack finds its server, its key and its default model (docs/contract.md §7.1).

Pure: reads the environment, the settings file and (for discovery) the `gmlx` command line;
imports neither ComfyUI nor torch, so it is tested on its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
DEFAULT_MODEL = "z-image-turbo"
SETTINGS_ENV = "GMLX_COMFY_SETTINGS"
BASE_URL_ENV = "GMLX_BASE_URL"
API_KEY_ENV = "GMLX_API_KEY"
DEFAULT_MODEL_ENV = "GMLX_DEFAULT_IMAGE_MODEL"
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return doc


def _text(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def run_gmlx_json(args: list[str], timeout: float = CLI_TIMEOUT_S) -> Any:
    """Run `gmlx <args>` and parse its stdout as JSON; None when gmlx is absent or fails."""
    exe = shutil.which("gmlx")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, *args], capture_output=True, timeout=timeout, text=True, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    try:
        return json.loads(done.stdout)
    except ValueError:
        return None


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


@dataclass(frozen=True)
class Settings:
    """What the environment and the settings file say; node widgets override `base_url`."""

    base_url: str  # "" when nothing names one explicitly
    api_key: str | None
    default_model: str
    path: Path

    def candidate_urls(self, widget_url: str = "", discover=None) -> list[str]:
        """The URLs to try in order (docs/contract.md §7.1, §7.2).

        An explicit URL (widget, env or file) is the only candidate unless it is the default
        one; otherwise the discovered URL (`gmlx status --json`) comes first, then the default.
        `discover` is a callable returning the discovered URL (tests pass their own).
        """
        explicit = _text(widget_url) or self.base_url
        if explicit and normalise_url(explicit) != DEFAULT_BASE_URL:
            return [normalise_url(explicit)]
        found = (discover or discover_url)()
        urls = [normalise_url(found)] if found else []
        if DEFAULT_BASE_URL not in urls:
            urls.append(DEFAULT_BASE_URL)
        return urls


def normalise_url(url: str) -> str:
    """Strip whitespace and trailing slashes; add http:// when no scheme is given."""
    url = url.strip().rstrip("/")
    if url and "://" not in url:
        url = "http://" + url
    return url


def discover_url() -> str:
    """The URL `gmlx status --json` reports, or ""."""
    return discovered_url(run_gmlx_json(["status", "--json"]))


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    """Resolve the settings from the environment and the settings file (docs/contract.md §7.1)."""
    env = os.environ if environ is None else environ
    path = settings_path(env)
    doc = read_settings(path)
    base_url = _text(env.get(BASE_URL_ENV)) or _text(doc.get("base_url"))
    api_key = _text(env.get(API_KEY_ENV)) or _text(doc.get("api_key")) or None
    default_model = (
        _text(env.get(DEFAULT_MODEL_ENV)) or _text(doc.get("default_model")) or DEFAULT_MODEL
    )
    return Settings(base_url=base_url, api_key=api_key, default_model=default_model, path=path)


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
