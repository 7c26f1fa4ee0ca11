"""The images the OpenAI routes answer by URL (`response_format: "url"`), kept for a bounded time
and space.

Each image is a file named by a random 128-bit token (`<32 hex>.<png|jpeg|webp>`) in one folder:
`[server.image] image_url_dir`, or a temporary folder made for the server and removed at stop.
A name is served only when it is of that form and in this store's own index, so no path a
client sends reaches the file system. An image expires `image_url_ttl_s` after it was made
(a sweeper removes it then, whether or not anyone asks), and the oldest images go first when
the store would hold more than `image_url_store_mb`. In `image_url_dir` each server keeps its
images in a folder of its own, `server-<host>-<pid>`, so servers sharing one configuration keep
each other's images: at start a server empties its own and removes those of this host's
processes that no longer run (and loose image files an earlier layout left), so a restarted
server serves none it did not make; at stop it removes its own.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .engine.processes import remove_left_by_gone, this_host

log = logging.getLogger("gmlx.server")

CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
NAME_RE = re.compile(r"[0-9a-f]{32}\.(png|jpeg|webp)")
# one server's images in image_url_dir: its host's name and its process id
SERVER_FOLDER_RE = re.compile(r"server-(?P<host>.+)-(?P<pid>\d+)")
MAX_SWEEP_S = 30.0


class StoreFull(Exception):
    """One image larger than the whole store (the operator's bound)."""


@dataclass(frozen=True)
class Entry:
    expires: float  # time.monotonic()
    size: int


class ImageStore:
    def __init__(self, folder: Path | None, ttl_s: float, max_bytes: int) -> None:
        if folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="gmlx-images-"))
        else:
            folder.mkdir(parents=True, exist_ok=True)
            _remove_gone_servers(folder)
            self.folder = folder / f"server-{this_host()}-{os.getpid()}"
            self.folder.mkdir(exist_ok=True)
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._remove_strays()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="gmlx-images", daemon=True)
        self._sweeper.start()

    def put(self, data: bytes, image_format: str) -> str:
        """Keep one encoded image; its file name (the URL's last part)."""
        if len(data) > self.max_bytes:
            raise StoreFull(
                f"an image of {len(data)} bytes is larger than the image store"
                f" ([server.image] image_url_store_mb)"
            )
        name = f"{secrets.token_hex(16)}.{image_format}"
        partial = self.folder / f".{name}.partial"
        self.folder.mkdir(parents=True, exist_ok=True)  # removed by hand meanwhile: made again
        partial.write_bytes(data)
        os.replace(partial, self.folder / name)
        with self._lock:
            self._entries[name] = Entry(time.monotonic() + self.ttl_s, len(data))
            self._bytes += len(data)
            self._evict(time.monotonic())
        return name

    def get(self, name: str) -> tuple[bytes, str] | None:
        """An image's bytes and content type; None when the name is no image of this store now."""
        if not NAME_RE.fullmatch(name):
            return None
        with self._lock:
            self._evict(time.monotonic())
            if name not in self._entries:
                return None
        try:
            data = (self.folder / name).read_bytes()
        except FileNotFoundError:
            return None
        return data, CONTENT_TYPES[name.rsplit(".", 1)[1]]

    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def close(self) -> None:
        self._stop.set()
        self._sweeper.join(timeout=MAX_SWEEP_S + 1)
        with self._lock:
            names = list(self._entries)
            self._entries.clear()
            self._bytes = 0
        for name in names:
            self._unlink(name)
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- upkeep -----------------------------------------------------------------------

    def _evict(self, now: float) -> None:
        """Drop expired images, then the oldest while over the bound (under the lock)."""
        while self._entries:
            name, entry = next(iter(self._entries.items()))
            if entry.expires > now and self._bytes <= self.max_bytes:
                break
            del self._entries[name]
            self._bytes -= entry.size
            self._unlink(name)

    def _sweep_loop(self) -> None:
        period = min(MAX_SWEEP_S, max(0.05, self.ttl_s / 4))
        while not self._stop.wait(period):
            with self._lock:
                self._evict(time.monotonic())

    def _unlink(self, name: str) -> None:
        try:
            (self.folder / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("image store: could not remove %s: %s", name, exc)

    def _remove_strays(self) -> None:
        """An earlier process's images in this store's folder (one of the same pid)."""
        _remove_images(self.folder)


def _remove_images(folder: Path) -> None:
    for path in folder.iterdir():
        stray = NAME_RE.fullmatch(path.name) or (
            path.name.startswith(".") and path.name.endswith(".partial")
        )
        if stray and path.is_file():
            path.unlink(missing_ok=True)


def _remove_gone_servers(root: Path) -> None:
    """The image folders in `root` of servers whose process no longer runs, and the loose image
    files an earlier layout kept there; another running server's folder is left alone."""
    _remove_images(root)
    remove_left_by_gone(root, SERVER_FOLDER_RE)
