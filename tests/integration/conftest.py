"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import kmock
import pytest

from tests.integration.fakekube import FakeKube


@pytest.fixture
async def fake() -> AsyncIterator[FakeKube]:
    """A mock Kubernetes API (`tests/integration/fakekube.py`) serving on loopback."""
    async with FakeKube() as handler, kmock.Server(handler):
        yield handler
