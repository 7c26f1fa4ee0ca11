"""Setting up a gmlx process: what the commands that run MLX (`gmlx serve`, `gmlx image`,
`gmlx model quantize`, a quantizing `gmlx pull`) do before they touch a model: keep megabyte
buffers in glibc's allocator and put an optimised BLAS under MLX (`prepare_process`, before mlx
is imported); and the model registry of a configuration that `serve` and `image` build
(`config_registry`, with the embedded models when no default_model is configured, else the
one it names).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("gmlx.server")


def prepare_process() -> None:
    """Keep megabyte buffers in the allocator (`tune_malloc`) and give MLX an optimised BLAS
    (`fast_blas`); first thing, before threads allocate and before mlx is imported."""
    tune_malloc()
    fast_blas()


def prepared_for(command: str) -> bool:
    """`prepare_process` for the command `gmlx <command>`: False where it cannot be prepared
    (GMLX_BLAS naming a library that cannot be loaded), said on one line; the command then
    exits 2."""
    try:
        prepare_process()
    except RuntimeError as exc:
        print(f"gmlx {command}: {exc}", file=sys.stderr)
        return False
    return True


def fast_blas() -> None:
    """Give MLX an optimised BLAS (engine/blas.py) where the server extra is installed; before
    anything imports mlx."""
    try:
        from .engine.blas import ensure_fast_blas
    except ImportError:
        return
    ensure_fast_blas()


def config_registry(config, model: str | None = None):
    """The model registry of a configuration, its default model `model` or else the configured
    one or else the embedded default; with no default_model configured the embedded models'
    folders join as extra folders, so `model` may name one (with one configured, the embedded
    model it names or `model` names, if either names one). Models load with their entries'
    configured adapters and load settings (config.ServerConfig.load_settings_for: `--quantize`
    over the entry's `quantize`). Returns (registry, extra folders)."""
    from .engine.registry import ModelRegistry
    from .lora_files import DefaultAdapters

    extra, embedded_default = _embedded_models(config, model)
    default = model or config.default_model or embedded_default
    hooks = DefaultAdapters(config.models) if config.models else None
    registry = ModelRegistry(
        config.model_dirs,
        default,
        extra_models=extra,
        load_hooks=hooks,
        settings=config.load_settings_for,
        component_sets=config.component_sets,
    )
    unknown = sorted(set(config.models) - set(registry.folders()))
    if unknown:  # a folder may still appear later: the model dirs are listed on each lookup
        log.warning(
            "configured model entries with no model folder or servable files (yet): %s",
            ", ".join(unknown),
        )
    return registry, extra


def _embedded_models(config, model: str | None = None) -> tuple[list[Path], str | None]:
    """The embedded models the configuration serves (engine/registry.py's
    `embedded_modules_served`), and the one `model` names, their folders generated on first use
    to join the registry as extra model folders; and the default model: the configured one,
    else the embedded default. Returns (extra folders, default id)."""
    from .engine.registry import embedded_modules_served  # imports numpy: after tune_malloc

    modules = embedded_modules_served(config.default_model, config.model_dirs)
    if model and config.default_model:
        named = embedded_modules_served(model, config.model_dirs)
        modules += [module for module in named if module not in modules]
    folders = [Path(module.RECIPE.ensure()) for module in modules]
    if config.default_model:
        return folders, config.default_model
    if not folders:
        log.warning("no default_model configured and no embedded default model available")
        return [], None
    return folders, folders[0].name


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc's largest allowed mmap threshold on 64-bit systems.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 256 << 20


def tune_malloc() -> bool:
    """Keep freed megabyte buffers in the process instead of returning them to the OS per
    request (about 1,500 page faults for a 2 MiB step each way otherwise: docs/benchmarks.md). This is
    what MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ would do at process start, set through
    mallopt so no re-exec is needed; variables the user set win. glibc only."""
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1 and ok
    if "MALLOC_ARENA_MAX" not in os.environ:
        # One arena for every thread. A thread's own arena lives in 64 MiB heaps that glibc
        # unmaps as soon as one is wholly free, whatever the trim threshold: measured, the
        # step's work (one thread) churned ~290 of them per step and every 2 MiB body buffer of
        # an HTTP thread came back as fresh pages (1,500 faults a step). Set before threads
        # allocate, which is why this runs first.
        ok = mallopt(_M_ARENA_MAX, 1) == 1 and ok
    return ok
