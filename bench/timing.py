"""Timing shared by the bench scripts."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int) -> float:
    """The median wall time of `repeats` calls of `fn`, in ms, after one untimed warm-up call
    (first-call allocation and kernel setup)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)
