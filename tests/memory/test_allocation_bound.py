"""The plan's bound on MLX's allocations while a forward runs (memory.allocation_bound)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from gmlx_server.memory import LIMIT_FRACTION, allocation_bound

MB = 1 << 20
SIDE = 256  # a (SIDE, SIDE) float32 matrix is 1/4 MiB


def chain_peak(links: int, bound: int | None) -> int:
    """MLX's peak above what it held before, evaluating `links` matmuls in a chain, each of
    whose outputs (1/4 MiB) feeds only the next: the chain's own live set is two links."""
    weight = mx.random.normal((SIDE, SIDE)) * (SIDE**-0.5)
    x = mx.random.normal((SIDE, SIDE))
    mx.eval(weight, x)
    for _ in range(links):
        x = x @ weight
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    if bound is None:
        mx.eval(x)
    else:
        with allocation_bound(bound):
            mx.eval(x)
    mx.synchronize()
    return mx.get_peak_memory() - base


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="times the CPU stream")
def test_the_bound_stops_mlx_allocating_far_ahead_of_the_work():
    # Unbounded, MLX allocates each output as it queues the matmul, ~100 ahead of the stream
    # computing them (each takes milliseconds, queueing microseconds): far over the live set.
    assert chain_peak(120, None) > 8 * MB
    # Bounded by a plan of 1 MiB over what was held, it queues no more while over: at most
    # the ten operations it dispatches between two waits (2.5 MiB) beyond the limit.
    assert chain_peak(120, MB) < MB + 3 * MB


def test_the_limit_is_set_for_the_work_and_restored_after():
    before = mx.get_memory_limit()
    with allocation_bound(100 * MB):
        assert mx.get_memory_limit() == mx.get_active_memory() + int(LIMIT_FRACTION * 100 * MB)
    assert mx.get_memory_limit() == before
    with pytest.raises(ValueError), allocation_bound(0):
        raise ValueError("the work failed")
    assert mx.get_memory_limit() == before
