"""The reliability suite reuses the conformance suite's live servers (tests/server/conftest.py)."""

from __future__ import annotations

from ..server.conftest import fresh, live, server_factory  # noqa: F401 - fixtures
