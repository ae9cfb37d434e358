"""Forms that change something (log in, log out) are refused when a browser says another site sent
them: cross-site request forgery cannot log a visitor in with an attacker's token nor log them
out. A real server on PostgreSQL, spoken to over HTTP with the headers a browser would send.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts

from ckptstore.service.api import create_app
from ckptstore.service.api.pages.views import SAFE_METHODS, PageRoute
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.dom import parse
from tests.pages.kit import READ_TOKEN, TOKENS
from tests.pages.pg_server import served_on_postgres

#: Every page route that changes state, with a form body that would succeed from this server.
FORMS = {("POST", "/login"): {"token": READ_TOKEN, "next": "/"}, ("POST", "/logout"): {}}


@pytest.fixture(scope="module")
def base_url(postgres_databases: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's URL."""
    with served_on_postgres(postgres_databases, tmp_path_factory.mktemp("origin")) as url:
        yield url


@pytest.fixture
def http(base_url: str) -> Iterator[httpx.Client]:
    """A client that does not follow redirects and keeps no cookies between tests."""
    with httpx.Client(base_url=base_url, follow_redirects=False, timeout=30) as client:
        yield client


def state_changing_page_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path) of every page route whose method can change something."""
    found = set()
    for context in iter_route_contexts(app.routes):
        if isinstance(context.original_route, PageRoute):
            found |= {(method, str(context.path)) for method in context.methods or () if method not in SAFE_METHODS}
    return found


def test_the_forms_checked_here_are_every_state_changing_page_route(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    try:
        app = create_app(store, Settings(home=tmp_path / "home", tokens=TOKENS))
        assert state_changing_page_routes(app) == set(FORMS), "a form route was added: list it in FORMS"
    finally:
        store.close()


def other_sites(base_url: str) -> dict[str, dict[str, str]]:
    """Headers of forms sent from elsewhere: another site, another port, a sandboxed page."""
    port = urlsplit(base_url).port
    return {
        "other-site": {"Origin": "https://evil.example"},
        "other-port": {"Origin": f"http://127.0.0.1:{(port or 0) + 1}"},
        "other-host-same-ip": {"Origin": f"http://localhost:{port}"},
        "null": {"Origin": "null"},
        "referer-only": {"Referer": "https://evil.example/forms/logout.html"},
        "origin-wins-over-referer": {"Origin": "https://evil.example", "Referer": f"{base_url}/logout"},
    }


@pytest.mark.parametrize(("method", "path"), sorted(FORMS))
@pytest.mark.parametrize(
    "source",
    ["other-site", "other-port", "other-host-same-ip", "null", "referer-only", "origin-wins-over-referer"],
)
def test_a_form_from_another_site_is_refused(
    base_url: str, http: httpx.Client, method: str, path: str, source: str
) -> None:
    headers = other_sites(base_url)[source]
    response = http.request(method, path, data=FORMS[method, path], headers=headers)
    assert response.status_code == 403, response.text
    assert response.headers["x-error-code"] == "forbidden"
    assert response.headers["content-type"].startswith("text/html")
    assert "set-cookie" not in response.headers  # neither logged in nor logged out
    message = parse(response.text).one("p", class_="message").text
    assert "sent from another site" in message and f"open {path} on this server" in message


@pytest.mark.parametrize(("method", "path"), sorted(FORMS))
@pytest.mark.parametrize("source", ["origin", "referer", "neither"])
def test_a_form_from_this_server_or_no_browser_is_served(
    base_url: str, http: httpx.Client, method: str, path: str, source: str
) -> None:
    """A form from this server goes through; so does a request with neither header (curl, scripts)."""
    headers = {"origin": {"Origin": base_url}, "referer": {"Referer": f"{base_url}{path}"}, "neither": {}}[source]
    response = http.request(method, path, data=FORMS[method, path], headers=headers)
    assert response.status_code == 303, response.text
    assert "set-cookie" in response.headers


def test_another_site_cannot_log_a_visitor_out(base_url: str, http: httpx.Client) -> None:
    login = http.post("/login", data={"token": READ_TOKEN, "next": "/"}, headers={"Origin": base_url})
    assert login.status_code == 303 and http.cookies.get("ckptstore_token") == READ_TOKEN
    forged = http.post("/logout", headers={"Origin": "https://evil.example"})
    assert forged.status_code == 403
    assert http.cookies.get("ckptstore_token") == READ_TOKEN
    assert http.get("/").status_code == 200  # still logged in
    real = http.post("/logout", headers={"Origin": base_url})
    assert real.status_code == 303 and "ckptstore_token" not in http.cookies
    assert http.get("/").status_code == 303  # now sent to /login
