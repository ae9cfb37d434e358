"""Fixtures for the HTTP API tests: an embedded store in a temporary home, the app over it,
a TestClient (the real ASGI app in-process) and a real uvicorn server on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, Finished, Served
from tests.servers import running_server


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """The store's home folder (everything the server may write lives below it)."""
    return tmp_path / "home"


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """Settings a test module changes (override this fixture in the module)."""
    return {}


@pytest.fixture
def settings(home: Path, settings_overrides: dict[str, Any]) -> Settings:
    """Server settings: three tokens (read, write, admin) and the module's overrides."""
    return Settings(home=home, tokens=TOKENS, **settings_overrides)


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    """An empty embedded store (SQLite + local folder) in ``home``."""
    opened = Store.open_home(settings.home_path)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def app(store: Store, settings: Settings) -> FastAPI:
    """The application serving ``store``."""
    return create_app(store, settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    """The ASGI app in-process; server errors come back as 500 responses, not exceptions."""
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as test_client:
        yield test_client


@pytest.fixture
def serve() -> Iterator[Callable[[FastAPI], Served]]:
    """Start real uvicorn servers for apps; all stop when the test ends."""
    with ExitStack() as stack:

        def start(app: FastAPI) -> Served:
            finished = Finished(app)
            return Served(stack.enter_context(running_server(finished)), finished)  # type: ignore[arg-type]

        yield start


@pytest.fixture
def server(app: FastAPI, serve: Callable[[FastAPI], Served]) -> Served:
    """``app`` served by uvicorn on a free loopback port."""
    return serve(app)
