"""PrefixCache bookkeeping: run pins, run end, the LRU byte budget."""

from __future__ import annotations

import mlx.core as mx
from gmlx_server.engine.families.qwen_image21.dit import PrefixState
from gmlx_server.engine.prefix_cache import PrefixCache


def state(nbytes: int) -> PrefixState:
    array = mx.zeros((nbytes // 8,), mx.float32)
    return PrefixState(keys=[array], values=[array], length=1, target_frame=1)


def test_unpinned_states_are_shed_least_recently_used():
    cache = PrefixCache(budget_bytes=200)
    cache.put(("a",), state(100), run=None)
    cache.put(("b",), state(100), run=None)
    cache.get(("a",))  # a is now the most recently used
    cache.put(("c",), state(100), run=None)
    assert ("a",) in cache and ("c",) in cache and ("b",) not in cache


def test_run_states_stay_past_the_budget_until_the_run_ends():
    cache = PrefixCache(budget_bytes=100)
    cache.put(("a",), state(100), run="r1")
    cache.put(("b",), state(100), run="r1")
    cache.put(("c",), state(100), run=None)
    assert ("a",) in cache and ("b",) in cache and ("c",) in cache
    cache.end_run("r1")
    assert ("a",) not in cache and ("b",) not in cache and ("c",) in cache


def test_a_state_two_runs_share_lives_until_both_end():
    cache = PrefixCache(budget_bytes=0)
    cache.put(("a",), state(100), run="r1")
    cache.pin(("a",), "r2")
    cache.end_run("r1")
    assert ("a",) in cache
    cache.end_run("r2")
    assert ("a",) not in cache


def test_a_state_held_before_a_run_is_pinned_by_it():
    cache = PrefixCache(budget_bytes=1000)
    cache.put(("a",), state(100), run=None)
    cache.pin(("a",), "r1")
    cache.budget_bytes = 0
    cache.put(("b",), state(100), run=None)
    assert ("a",) in cache and ("b",) not in cache
