"""This machine's processes as another process sees them: whether one of an id runs
(`process_runs`), and this host's name as a file name may hold it (`this_host`). A folder a
process writes names both, so that what a process that has gone left is told from what a live
one writes, and removed (`remove_left_by_gone`). Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path


def process_runs(pid: int) -> bool:
    """Whether a process of this id runs (one of another user's counts: it exists)."""
    if pid <= 0:  # 0 and below name process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def this_host() -> str:
    """This machine's name as a folder name may hold it."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname()) or "host"


def remove_left_by_gone(root: Path, pattern: re.Pattern) -> None:
    """Remove the folders in `root` whose name `pattern` matches, its groups `host` and `pid`
    naming a process of this host that no longer runs (another host's are not seen here)."""
    for path in root.iterdir():
        held = pattern.fullmatch(path.name)
        if held and held["host"] == this_host() and path.is_dir():
            if not process_runs(int(held["pid"])):
                shutil.rmtree(path, ignore_errors=True)
