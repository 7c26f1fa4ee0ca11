"""Suite-wide.

- Long load and fuzz runs (marker `heavy`) run only when asked for with `pytest -m heavy`; a
  plain `pytest` collects and skips them.
- Under pytest-xdist (`pytest -n auto`) each worker computes with one thread: the workers
  already fill the cores, and torch's OpenMP or MKL threads of two workers on two cores made a
  small diffusers pass fourteen times slower than alone. Set before any test module imports torch,
  and inherited by the processes the tests start.
- The modules that take longest run first (`SLOW_FIRST`): a worker that runs out of tests
  takes some of the other's (`--dist worksteal`, pyproject.toml), but not a test under way, so
  a long test left to the end would keep the run waiting on it alone.
- Python writes its bytecode caches (gitignored `__pycache__`) even where the environment says
  not to (`PYTHONDONTWRITEBYTECODE`): the run starts many processes (the workers, and the
  servers, ranks and commands the tests start) that import the same modules, and each compiled
  them all again (on two cores the suite took 4:19 from a clean checkout against 4:28, and
  4:10 once the caches are there). Set before the workers start, and inherited: the caches
  land beside every module the run imports, a ComfyUI checkout's (COMFYUI_DIR) included.
- Hypothesis draws the same examples on every default run (`derandomize`), so a run that
  passes here passes on any machine; `pytest -m heavy` draws new ones on each run, to find
  what those miss (a failure prints the seed that repeats it).
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

# Path prefixes under tests/, longest-running first (pytest --durations shows them).
SLOW_FIRST = (
    "tests/shard/",
    "tests/vaes/",
    "tests/families/qwen_image21/test_estimates.py",
    "tests/families/flux2_klein/",
    "tests/families/z_image/",
    "tests/families/qwen_image21/",
)


def pytest_configure(config):
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    settings.register_profile("gmlx", derandomize=not _heavy(config))
    settings.load_profile("gmlx")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for name in THREAD_VARIABLES:
            os.environ.setdefault(name, "1")


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank(config))  # a stable sort: order within a module is kept
    if _heavy(config):
        return
    skip = pytest.mark.skip(reason="heavy run: select it with pytest -m heavy")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


def _heavy(config) -> bool:
    """Whether the run selects the heavy tier (`-m heavy`)."""
    return "heavy" in (config.getoption("markexpr") or "")


def _slow_rank(config):
    root = config.rootpath

    def rank(item) -> int:
        path = item.path.relative_to(root).as_posix()
        return next(
            (i for i, prefix in enumerate(SLOW_FIRST) if path.startswith(prefix)),
            len(SLOW_FIRST),
        )

    return rank
