"""Where this user's running `gmlx serve` processes listen. Each writes a record while it
serves (`serving`), so that `gmlx status`, and the ComfyUI pack through it, finds a server that
was started on another port or with another config file than the one it reads, and does not
start a second server beside it.

A record is a JSON file named by the process id in the user's cache folder (`records_folder`):
{"url", "pid", "config", "started"}. The server removes its own when it stops; one that a
killed server left behind is removed by the next reader, which finds no such process. Imports
nothing beyond the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .engine.cache_home import cache_home
from .engine.processes import process_runs

FOLDER = "servers"


def records_folder() -> Path | None:
    """None where this user has no home folder to find it in (a service user without one)."""
    try:
        return cache_home() / FOLDER
    except RuntimeError:  # Path.home() with no HOME and no password entry
        return None


@contextlib.contextmanager
def serving(url: str, config: Path | None) -> Iterator[Path | None]:
    """Keep a record of this process serving at `url` (with the config file it read) while the
    block runs. A record that cannot be written is only missed by `gmlx status`: the yielded
    path is then None and serving goes on."""
    folder = records_folder()
    record = {
        "url": url,
        "pid": os.getpid(),
        "config": str(Path(config).resolve()) if config else None,  # found from any folder
        "started": time.time(),
    }
    path = None if folder is None else folder / f"{os.getpid()}.json"
    try:
        if path is not None:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(record))
            partial.replace(path)
    except OSError:
        path = None
    try:
        yield path
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def running_servers() -> list[dict[str, Any]]:
    """The records of the servers that still run, the latest started first; the records of
    processes that have gone, and files of the folder that are no record, are removed."""
    records, folder = [], records_folder()
    for path in sorted(folder.glob("*.json")) if folder is not None else []:
        if not _own(path):  # another user's file: its URL would get this user's API key
            continue
        record = _read(path)  # None: not a record (one is written whole, then renamed)
        if record is None or not process_runs(record["pid"]):
            with contextlib.suppress(OSError):  # another's record, or a folder not writable
                path.unlink()
            continue
        records.append(record)
    return sorted(records, key=lambda record: -record["started"])


def _read(path: Path) -> dict[str, Any] | None:
    """A record as written by `serving`, else None (unreadable, or not one)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    fields = {"url": str, "pid": int, "started": (int, float)}
    if not isinstance(record, dict) or not all(
        isinstance(record.get(key), kind) and not isinstance(record.get(key), bool)
        for key, kind in fields.items()
    ):
        return None
    return record


def _own(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False
