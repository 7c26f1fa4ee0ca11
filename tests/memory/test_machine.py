"""The planner's reading of the machine's memory."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_kept_proc_files_read_the_present_not_their_first_reading():
    from gmlx_server.memory import _PROC, _linux_bytes

    def resident_pages() -> int:
        return int(_PROC.read("/proc/self/statm").split()[1])

    before = resident_pages()
    fresh = mmap.mmap(-1, 64 * 1024 * 1024)  # new pages, not memory malloc kept from before
    np.frombuffer(fresh, dtype=np.uint8)[:] = 1  # every page written
    assert resident_pages() - before >= 12_000  # 4 KiB pages: most of 16,384 now resident
    assert _linux_bytes() > len(fresh)
