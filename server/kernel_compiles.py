"""Saying so while MLX compiles its CPU kernels.

On its CPU backend MLX builds each fused kernel of an `mx.compile`d function with the C++
compiler the first time the kernel is needed: it writes the kernel's source to
`<temp dir>/mlx/<mlx version>/cpu/<name>.cpp`, compiles `lib<name>.so` beside it and loads that
(mlx/backend/cpu/compiled.cpp; the temp dir is C++'s `temp_directory_path()`: TMPDIR, TMP, TEMP
or TEMPDIR, else /tmp). A library already there is loaded without compiling, by this process and
every later one, so compiling happens once per machine (until the temp dir is cleared). For the
embedded default model that is 24 kernels of about a second each, all in the first step: tens of
seconds in which nothing else moves.

`CompileWatch` looks at that folder from a thread of its own and reports when new kernel files
appear (compiling) and when every source has its library and the folder has been quiet for a
moment (done). It reports compiles of any process that shares the folder.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

POLL_S = 0.25  # how often the folder is looked at (a stat; a listing only when it changed)
QUIET_S = 1.0  # no new source or library for this long, none pending: compiling is done
TEMP_VARIABLES = ("TMPDIR", "TMP", "TEMP", "TEMPDIR")  # in the order C++ reads them


def kernel_folder() -> Path | None:
    """Where MLX keeps its compiled CPU kernels; None without MLX."""
    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return None
    temp = next((os.environ[name] for name in TEMP_VARIABLES if os.environ.get(name)), "/tmp")
    return Path(temp) / "mlx" / version / "cpu"


def pending_kernels(names: set[str]) -> set[str]:
    """The kernels of a folder listing that have a source but no library yet. MLX writes a
    kernel's `<name>.cpp` and compiles `lib<name>.so`; mlx 0.32 compiles `tmp_<id>.cpp` to
    `tmp_<id>.so` first and then renames both."""
    sources = {name[: -len(".cpp")] for name in names if name.endswith(".cpp")}
    libraries = {name[: -len(".so")] for name in names if name.endswith(".so")}
    return {stem for stem in sources if stem not in libraries and f"lib{stem}" not in libraries}


class CompileWatch:
    """Reports (`report(text)`, from the watch's thread) MLX compiling CPU kernels into `folder`
    while the watch runs: one line when compiling starts, one when it is done."""

    def __init__(
        self,
        report: Callable[[str], None],
        folder: Path | None = None,
        *,
        poll_s: float = POLL_S,
        quiet_s: float = QUIET_S,
    ) -> None:
        self.report = report
        self.folder = folder if folder is not None else kernel_folder()
        self.poll_s, self.quiet_s = poll_s, quiet_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gmlx-compile-watch", daemon=True)
        self._stamp: int | None = None
        self._seen: set[str] = set()  # every file name looked at so far
        self._stale: set[str] = set()  # sources without a library when the watch began
        self._pending: set[str] = set()  # sources without a library now (being compiled)
        self._since: float | None = None  # compiling since (monotonic), or None
        self._compiled = 0
        self._changed = 0.0

    def __enter__(self) -> CompileWatch:
        if self.folder is not None:
            listing = self._listing()
            self._seen = listing  # what was there before is not news,
            self._stale = pending_kernels(listing)  # nor sources left by an interrupted compile
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._since is not None:  # stopped mid-way: say how far it got
            self._finish(time.monotonic())

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.look()

    def look(self) -> None:
        """One look at the folder (the watch's thread calls this every poll_s)."""
        now = time.monotonic()
        try:
            stamp = self.folder.stat().st_mtime_ns
        except OSError:
            return  # not made yet: nothing compiled on this machine so far
        if stamp != self._stamp or self._since is not None:  # (a coarse stamp may lag)
            self._stamp = stamp
            listing = self._listing()
            self._news(listing, now)
        if self._since is not None and not self._pending and now - self._changed >= self.quiet_s:
            self._finish(self._changed)

    def _listing(self) -> set[str]:
        try:
            return {entry.name for entry in os.scandir(self.folder)}
        except OSError:
            return set()

    def _news(self, listing: set[str], now: float) -> None:
        new = {name for name in listing - self._seen if name.endswith((".cpp", ".so"))}
        pending = pending_kernels(listing) - self._stale
        self._seen |= listing
        if not new and pending == self._pending:
            return
        self._changed, self._pending = now, pending
        if self._since is None:
            self._since, self._compiled = now, 0
            self.report(
                "compiling MLX's CPU kernels with the C++ compiler (once: they are kept in "
                f"{self.folder} for later runs)"
            )
        self._compiled += sum(1 for name in new if name.startswith("lib") and name.endswith(".so"))

    def _finish(self, until: float) -> None:
        seconds, count = until - self._since, self._compiled
        self._since = None
        self.report(f"compiled {count} MLX CPU kernel(s) in {seconds:.1f} s")
