"""Fixtures for client tests: a fresh store per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import client


@pytest.fixture
def store_home(tmp_path: Path) -> Path:
    """The folder of the embedded store used by the test."""
    return tmp_path / "store"


@pytest.fixture
def ckpt(store_home: Path) -> Iterator[client.Client]:
    """A client on a fresh embedded store."""
    with client.Client(home=store_home) as instance:
        yield instance
