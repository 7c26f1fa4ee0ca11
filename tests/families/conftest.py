"""The fixtures the family tests share."""

from __future__ import annotations

import pytest

from tests.families.routes import served_folder


@pytest.fixture(scope="module")
def server(folder):
    """The module's `folder` loaded behind the step routes of a server of its own
    (routes.served_folder), for the whole module."""
    with served_folder(folder) as running:
        yield running
