"""Fixtures for the page tests: one seeded store per module (the pages only read it), and apps
over it with or without tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.kit import TOKENS, seed


@pytest.fixture(scope="module")
def seeded_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store home holding runs alpha and long (see kit.seed)."""
    home = tmp_path_factory.mktemp("pages") / "home"
    store = Store.open_home(home)
    try:
        seed(store)
    finally:
        store.close()
    return home


@pytest.fixture
def store(seeded_home: Path) -> Iterator[Store]:
    """The seeded store."""
    opened = Store.open_home(seeded_home)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def open_app(store: Store, seeded_home: Path) -> FastAPI:
    """The app on loopback with no tokens: every page is open."""
    return create_app(store, Settings(home=seeded_home, tokens=None, host="127.0.0.1"))


@pytest.fixture
def client(open_app: FastAPI) -> Iterator[TestClient]:
    """A client of the open app; server errors come back as 500 responses."""
    with TestClient(open_app, raise_server_exceptions=False, base_url="http://127.0.0.1") as test_client:
        yield test_client


@pytest.fixture
def guarded(store: Store, seeded_home: Path) -> Iterator[TestClient]:
    """A client of the app with read and write tokens configured; redirects are not followed."""
    app = create_app(store, Settings(home=seeded_home, tokens=TOKENS, host="127.0.0.1"))
    with TestClient(
        app, raise_server_exceptions=False, follow_redirects=False, base_url="http://127.0.0.1"
    ) as test_client:
        yield test_client
