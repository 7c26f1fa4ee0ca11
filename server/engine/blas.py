"""Give MLX's Linux CPU backend an optimised BLAS, without the user having to know.

Why this exists: the `mlx[cpu]` wheels for Linux link the netlib reference BLAS (shipped in
`mlx_cpu.libs/`), whose float32 matmul is 10-60x slower than an optimised one. `libmlx.so`
imports `cblas_sgemm` and the LAPACK routines by plain, unversioned names, and the dynamic
linker looks a symbol up in the process's global scope before a library's own dependencies.
So a BLAS loaded with RTLD_GLOBAL *before* `mlx.core` is imported serves every MLX matmul; no
re-exec or LD_PRELOAD is needed. Loading it after MLX is imported has no effect (measured), which
is why the command line calls `ensure_fast_blas()` before anything imports mlx.

Where the library comes from, first found wins:
  1. `GMLX_BLAS=/path/to/libsomething.so` names one explicitly (`GMLX_BLAS=off` turns all this off);
  2. the `mkl` wheel from PyPI (a Linux x86_64 dependency of the `server` extra): `libmkl_rt`;
  3. the `ngsolve-openblas` wheel, if installed (OpenBLAS, dynamic-arch; needs the system's
     libgfortran.so.5, so it is an option rather than the dependency);
  4. a system OpenBLAS or MKL by soname (Debian/Ubuntu `libopenblas0`, `libmkl-rt`).
A library qualifies only if it exports `cblas_sgemm` under that plain name (the `scipy-openblas`
wheels prefix theirs, `blis` exports none). Thread counts follow the library's own variables
(`MKL_NUM_THREADS`, `OPENBLAS_NUM_THREADS`). On macOS MLX uses Accelerate and this does nothing.

Idle BLAS threads are told to sleep at once instead of spinning (`KMP_BLOCKTIME=0` for MKL's
Intel OpenMP, `OPENBLAS_THREAD_TIMEOUT=4` for OpenBLAS; values the user set win): both spin for
0.1-0.2 s after every parallel call by default, and a step's forward ends with BLAS calls just
before its HTTP answer is written, so on a 2-core machine the spinning thread held one of the two
cores for the whole of the step's transport.

Run `python -m gmlx_server.engine.blas` to see the choice and time MLX's matmul against numpy.
"""

from __future__ import annotations

import ctypes
import fnmatch
import importlib.metadata
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "GMLX_BLAS"
_OFF_VALUES = {"off", "0", "no", "false", "reference"}
# The symbol that proves a library can stand in for MLX's reference BLAS.
_PROBE_SYMBOL = "cblas_sgemm"
# PyPI distributions shipping a BLAS with plain cblas_* names: (distribution, file name pattern).
_WHEEL_CANDIDATES = (
    ("mkl", "libmkl_rt.so*"),
    ("ngsolve-openblas", "libopenblas*.so*"),
)
# System libraries by soname, found through the dynamic linker's own search path.
_SYSTEM_CANDIDATES = ("libopenblas.so.0", "libmkl_rt.so.2", "libmkl_rt.so.3")
# How long idle BLAS threads spin before sleeping; read when the library loads, so set before.
# Measured after one 1024^3 matmul on 2 cores: 50-130 ms of CPU burnt in the next 100-300 ms idle
# by default (MKL: 200 ms block time; OpenBLAS: 2^28 cycles), none with these.
_IDLE_THREADS_SLEEP = {"KMP_BLOCKTIME": "0", "OPENBLAS_THREAD_TIMEOUT": "4"}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlasChoice:
    """What `ensure_fast_blas` did. `action` is one of:
    loaded (an optimised BLAS now serves MLX), off (turned off by GMLX_BLAS), not-linux,
    too-late (mlx was already imported), none-found (MLX keeps its reference BLAS)."""

    action: str
    library: str | None = None
    threads: int | None = None

    @property
    def message(self) -> str:
        if self.action == "loaded":
            threads = f", {self.threads} threads" if self.threads else ""
            return f"BLAS for MLX: {self.library}{threads} (set {ENV_VAR}=off to disable)"
        return {
            "off": f"BLAS for MLX: MLX's reference BLAS ({ENV_VAR}=off)",
            "not-linux": "BLAS for MLX: platform default",
            "too-late": "BLAS for MLX: mlx was imported before ensure_fast_blas(); "
            "keeping its slow reference BLAS",
            "none-found": "BLAS for MLX: no optimised BLAS found, float32 matmuls will be slow; "
            "`pip install mkl` (x86_64) or install the system's libopenblas0, "
            f"or set {ENV_VAR}=/path/to/libopenblas.so",
        }[self.action]


_choice: BlasChoice | None = None


def ensure_fast_blas() -> BlasChoice:
    """Load an optimised BLAS for MLX if one is available; call before anything imports mlx.

    Idempotent: later calls return the first call's answer. Logs one line saying what it did.
    """
    global _choice
    if _choice is None:
        _choice = _choose()
        level = logging.WARNING if _choice.action in ("too-late", "none-found") else logging.INFO
        log.log(level, _choice.message)
    return _choice


def _choose() -> BlasChoice:
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting.lower() in _OFF_VALUES:
        return BlasChoice("off")
    if not sys.platform.startswith("linux"):
        return BlasChoice("not-linux")
    if "mlx.core" in sys.modules:
        return BlasChoice("too-late")
    candidates = [setting] if setting and setting.lower() != "auto" else _candidates()
    quiet_idle_threads()
    for candidate in candidates:
        library = _load_global(candidate)
        if library is not None:
            return BlasChoice(
                "loaded", _provider_path(_PROBE_SYMBOL) or candidate, _threads(library)
            )
    if setting and setting.lower() != "auto":
        raise RuntimeError(f"{ENV_VAR}={setting}: cannot load it, or it lacks {_PROBE_SYMBOL}")
    return BlasChoice("none-found")


def quiet_idle_threads() -> dict[str, str]:
    """Make idle BLAS threads sleep instead of spin, unless the user chose; returns what it set."""
    chosen = {name: value for name, value in _IDLE_THREADS_SLEEP.items() if name not in os.environ}
    os.environ.update(chosen)
    return chosen


def _candidates() -> Iterator[str]:
    for distribution, pattern in _WHEEL_CANDIDATES:
        yield from _wheel_libraries(distribution, pattern)
    yield from _SYSTEM_CANDIDATES


def _wheel_libraries(distribution: str, pattern: str) -> list[str]:
    """Files of an installed distribution matching `pattern`, wherever pip put them."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = [Path(f.locate()).resolve() for f in files if fnmatch.fnmatch(f.name, pattern)]
    return sorted({str(path) for path in found if path.is_file()})


def _load_global(name: str) -> ctypes.CDLL | None:
    """Load `name` into the global symbol scope if it exports the probe symbol, else None.

    It is opened locally first, so a library without the symbol never enters the global scope;
    the second open with RTLD_GLOBAL promotes the same loaded object."""
    try:
        probe = ctypes.CDLL(name, mode=ctypes.RTLD_LOCAL)
        getattr(probe, _PROBE_SYMBOL)
        return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError):
        return None


def _threads(library: ctypes.CDLL) -> int | None:
    """The library's own thread count, where it says (MKL or OpenBLAS)."""
    for getter in ("MKL_Get_Max_Threads", "openblas_get_num_threads"):
        function = getattr(library, getter, None)
        if function is not None:
            function.restype = ctypes.c_int
            return int(function())
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _provider_path(symbol: str) -> str | None:
    """The file that the global scope resolves `symbol` to, i.e. what libmlx.so will bind."""
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p)
        info = _DlInfo()
        if process.dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (OSError, AttributeError):
        pass
    return None


def _time_ms(function, repeat: int) -> float:
    """Best of `repeat` timed calls after one warm-up, in milliseconds."""
    import time

    function()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _benchmark(repeat: int = 3) -> None:
    """Time MLX float32 matmuls against numpy's on the same arrays; print a table."""
    import mlx.core as mx
    import numpy as np

    shapes = {
        "square 1024^3": (1024, 1024, 1024),
        "DiT 512^2 qkv": (1024 + 200, 4096, 4096),  # 1024 image + 200 text tokens, width 4096
    }
    rng = np.random.default_rng(0)
    print("shape           (m, k, n)            mlx ms   numpy ms  mlx GFLOP/s  rel L2 vs numpy")
    for label, (m, k, n) in shapes.items():
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        a_mx, b_mx = mx.array(a), mx.array(b)
        mx.eval(a_mx, b_mx)
        mlx_ms = _time_ms(lambda: mx.eval(a_mx @ b_mx), repeat)  # noqa: B023
        numpy_ms = _time_ms(lambda: a @ b, repeat)  # noqa: B023
        reference = a @ b
        error = np.linalg.norm(np.array(a_mx @ b_mx) - reference) / np.linalg.norm(reference)
        gflops = 2 * m * k * n / mlx_ms / 1e6
        print(
            f"{label:15s} {str((m, k, n)):20s} {mlx_ms:8.1f} {numpy_ms:10.1f}"
            f" {gflops:12.1f}  {error:.1e}"
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ensure_fast_blas()
    print(f"cpu cores: {os.cpu_count()}")
    _benchmark(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
