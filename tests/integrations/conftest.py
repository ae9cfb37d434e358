"""Integration tests run on an embedded store, and where marked on every backend of the client suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore import client
from tests.client.conftest import backend, ckpt  # noqa: F401  (fixtures: every backend)

# Models are built from configs; nothing is ever downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[client.Client]:
    """A client on an empty embedded store."""
    with client.Client(home=tmp_path / "store") as embedded:
        yield embedded
