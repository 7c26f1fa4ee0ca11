"""The user's cache folder of gmlx-steps: ~/.cache/gmlx-steps, or under $XDG_CACHE_HOME when
that is set. The embedded models, the component sets' folders and the records of the running
servers live below it. Imports nothing beyond the standard library, so the commands that only
look (`gmlx status`) read it without the server's packages."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gmlx-steps"
