"""Suite-wide: long load and fuzz runs (marker `heavy`) run only when asked for with
`pytest -m heavy`; a plain `pytest` skips them."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    if "heavy" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="heavy run: select it with pytest -m heavy")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)
