"""Prefix states by key, for the families whose DiT keeps per-conditioning state across steps
(docs/contract.md §3.3). A state is anything with `nbytes` (Qwen-Image 2.1: the K/V of its
prefix in every block). States a run used are pinned until the run ends (then shed); the others
are bounded by a byte budget and shed least-recently-used; a memory plan may shed any but the
step's own."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class PrefixCache:
    """Prefix states by key. States a run used are pinned until the run ends (then shed); the
    others are bounded by `budget_bytes` and shed least-recently-used."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._states: OrderedDict[tuple, Any] = OrderedDict()
        self._pins: dict[tuple, set[str]] = {}

    def __contains__(self, key: tuple) -> bool:
        return key in self._states

    def get(self, key: tuple) -> Any | None:
        state = self._states.get(key)
        if state is not None:
            self._states.move_to_end(key)
        return state

    def put(self, key: tuple, state: Any, run: str | None) -> None:
        self._states[key] = state
        self._states.move_to_end(key)
        self.pin(key, run)
        self._shed_unpinned()

    def pin(self, key: tuple, run: str | None) -> None:
        if run is not None and key in self._states:
            self._pins.setdefault(key, set()).add(run)

    def end_run(self, run: str) -> None:
        for key in [k for k, runs in self._pins.items() if run in runs]:
            runs = self._pins[key]
            runs.discard(run)
            if not runs:
                del self._pins[key]
                self._states.pop(key, None)

    def clear(self) -> None:
        self._states.clear()
        self._pins.clear()

    def keys(self) -> list[tuple]:
        return list(self._states)

    def keep_only(self, keys) -> None:
        """Drop every state but those of `keys` (a rank mirroring rank 0's cache: shard.py)."""
        keep = set(keys)
        for key in [k for k in self._states if k not in keep]:
            del self._states[key]
            self._pins.pop(key, None)

    def shed(self, need_bytes: int, keep: set) -> int:
        """Free states for a memory plan (docs/contract.md §3.3): those of finished work (unpinned) first,
        then those runs hold (a run's next step rebuilds them), least recently used first within
        each; never the keys in `keep`. Returns the bytes freed (may fall short)."""
        freed = 0
        for pinned in (False, True):
            for key in list(self._states):
                if freed >= need_bytes:
                    return freed
                if key in keep or (key in self._pins) != pinned:
                    continue
                freed += self._states.pop(key).nbytes
                self._pins.pop(key, None)
        return freed

    @property
    def unpinned_bytes(self) -> int:
        return sum(s.nbytes for k, s in self._states.items() if k not in self._pins)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())

    def _shed_unpinned(self) -> None:
        excess = self.unpinned_bytes - self.budget_bytes
        for key in list(self._states):
            if excess <= 0:
                break
            if key not in self._pins:
                excess -= self._states.pop(key).nbytes
