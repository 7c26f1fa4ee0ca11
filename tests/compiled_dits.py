"""DiTs built with their passes compiled, as a real, wide DiT runs them: on the CPU backend a
tiny one alone runs eagerly (server/engine/nn/compiled.py), so the tests of the compiled pass
(its parity, the memory plans that count its fused kernels' buffers) build theirs in here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from gmlx_server.engine.nn.compiled import SETTING


@contextmanager
def compiled_dits() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SETTING, "1")
        yield
