"""A DiT's per-step pass under `mx.compile`, as every family runs it.

`CompiledPass(function)` wraps a pure function of arrays (weights included). Called with a
signature (whatever decides the trace: the weight tree's id and the input shapes), it runs the
compiled function and evaluates its answer there, so that a failing run-time compile on the CPU
backend (no working g++) surfaces at once: the pass then runs eagerly from that call on, saying
so once. `GMLX_DIT_COMPILE=0` runs it eagerly from the start.

mx.compile keeps one trace per input signature for as long as the compiled function lives: a
server seeing many prompt lengths, sizes and LoRA tables would keep them all. After
SIGNATURES_KEPT signatures the compiled function is made anew, which drops every trace it held
(each is traced again on first use).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable

import mlx.core as mx

from . import cpu_ops

log = logging.getLogger(__name__)

SIGNATURES_KEPT = 64


def compile_enabled() -> bool:
    """Whether DiT passes run compiled (`GMLX_DIT_COMPILE`, "1" unless set to "0")."""
    return os.environ.get("GMLX_DIT_COMPILE", "1") != "0"


class CompiledPass:
    def __init__(self, function: Callable[..., mx.array], enabled: bool = True):
        """`enabled` false: always eager (a DiT sharded over ranks, whose collectives stay
        outside any compiled graph)."""
        self.function = function
        self.enabled = enabled and compile_enabled()
        self.compiled_function = mx.compile(function)
        self.signatures: set[Hashable] = set()  # those compiled_function has traced
        if self.enabled:
            cpu_ops.note_missing_compiler()

    def __call__(self, signature: Hashable, *arguments) -> mx.array:
        if self.enabled:
            try:
                out = self._compiled_for(signature)(*arguments)
                mx.eval(out)  # here, so that a failing run-time compile surfaces in this try
                return out
            except RuntimeError as error:
                if not cpu_ops.compile_failed(error):
                    raise
                self.enabled = False
                log.warning("mx.compile failed, the DiT runs eagerly from now on: %s", error)
        return self.function(*arguments)

    def _compiled_for(self, signature: Hashable) -> Callable[..., mx.array]:
        if signature not in self.signatures:
            if len(self.signatures) >= SIGNATURES_KEPT:
                self.compiled_function = mx.compile(self.function)  # the old traces go
                self.signatures.clear()
            self.signatures.add(signature)
        return self.compiled_function
