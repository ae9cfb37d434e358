"""A worker's routes are built at its start (service.api.warm_up), not during its first requests.

FastAPI builds an included router's routes the first time a request is matched against them;
the app's lifespan does that for every route before the worker takes connections, and the
request it uses for that is neither counted nor answered to anyone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import fastapi.routing
import pytest
from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.api.server import server_config
from ckptstore.service.api.warm_up import NO_ROUTE
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store

#: One request for a route of each router, in the order the app includes them, and a page.
FIRST_REQUESTS = [
    ("POST", "/v1/tensors/sizes", {"sizes": [4096]}),
    ("GET", "/v1/runs", None),
    ("GET", "/v1/runs/r/retention", None),
    ("GET", "/healthz", None),
    ("GET", "/", None),
    ("GET", "/openapi.json", None),
]


def count_route_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch FastAPI's building of a route's state to note the path of each route it builds."""
    built: list[str] = []
    original: Callable[..., Any] = fastapi.routing._populate_api_route_state

    def noting(route: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        built.append(path)
        return original(route, path, *args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "_populate_api_route_state", noting)
    return built


def ask_each(client: TestClient) -> list[int]:
    return [client.request(method, path, json=body).status_code for method, path, body in FIRST_REQUESTS]


def test_the_first_requests_of_a_started_app_build_no_route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    store = Store.open_home(home)
    with TestClient(create_app(store, Settings(home=home)), base_url="http://127.0.0.1") as client:
        built = count_route_builds(monkeypatch)
        statuses = ask_each(client)
        metrics = client.get("/metrics").text
    store.close()
    assert built == [] and 500 not in statuses
    assert NO_ROUTE not in metrics and 'route="unmatched"' not in metrics  # the warm-up counted nowhere


def test_without_the_start_the_first_requests_build_their_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    store = Store.open_home(home)
    client = TestClient(create_app(store, Settings(home=home)), base_url="http://127.0.0.1")  # no lifespan: no warm-up
    built = count_route_builds(monkeypatch)
    ask_each(client)
    store.close()
    assert "/v1/tensors/sizes" in built and "/healthz" in built


def test_ckptstore_serve_runs_the_lifespan(tmp_path: Path) -> None:
    config = server_config("ckptstore.service.api.server:app_from_env", Settings(home=tmp_path / "home"))
    assert config.lifespan != "off"
