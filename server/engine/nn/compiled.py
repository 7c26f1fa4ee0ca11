"""A DiT's per-step pass under `mx.compile`, as every family runs it.

`CompiledPass(function, width)` wraps a pure function of arrays (weights included). Called with a
signature (whatever decides the trace: the weight tree's id and the input shapes), it runs the
compiled function and evaluates its answer there, so that a failing run-time compile on the CPU
backend (no working g++) surfaces at once: the pass then runs eagerly from that call on, saying
so once.

Where compiling pays: on Metal and CUDA, always. On the CPU backend MLX builds each fused kernel
with g++ the first time it is needed (about a second each, once per machine: server/
kernel_compiles.py); a DiT narrower than COMPILED_FROM_WIDTH (the embedded random-weight models,
the tests' tiny ones) steps in milliseconds, so there the compile costs more than a first run
saves (the embedded default's first image waited about 30 s for its 24 kernels), and it runs
eagerly. `GMLX_DIT_COMPILE=0` runs every DiT eagerly, `GMLX_DIT_COMPILE=1` compiles every one.

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
# The narrowest DiT (its hidden width) that runs compiled on the CPU backend: real models are
# 3072 wide and more, the embedded and test models 256 and less.
COMPILED_FROM_WIDTH = 1024
SETTING = "GMLX_DIT_COMPILE"


def compile_enabled(width: int) -> bool:
    """Whether the passes of a DiT `width` wide run compiled: as `GMLX_DIT_COMPILE` says ("0"
    never, "1" always), else where compiling pays (above)."""
    setting = os.environ.get(SETTING)
    if setting is not None:
        return setting != "0"
    return width >= COMPILED_FROM_WIDTH or mx.default_device().type != mx.DeviceType.cpu


class CompiledPass:
    def __init__(self, function: Callable[..., mx.array], width: int, enabled: bool = True):
        """The pass `function` of a DiT `width` wide; `enabled` false: always eager (a DiT
        sharded over ranks, whose collectives stay outside any compiled graph)."""
        self.function = function
        self.enabled = enabled and compile_enabled(width)
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
