"""/docs: the API reference runs Swagger UI from files the package ships, behind the pages' login,
with a CSP that allows this server only; /openapi.json takes an API token; /redoc is gone.

A real server on PostgreSQL over HTTP, and headless Chromium (Debian's, driven by Playwright)
that must render every operation without one request leaving the server's origin.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import tomllib
from fastapi.testclient import TestClient
from playwright.sync_api import Browser, Route, sync_playwright

from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.dom import Node, parse
from tests.pages.kit import READ_TOKEN, WRITE_TOKEN
from tests.pages.pg_server import served_on_postgres
from tests.pages.test_browser import ARGS, CHROMIUM

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "service" / "api" / "pages"
VENDORED = API / "static" / "swagger-ui"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
#: swagger-ui-dist 5.35.0's swagger-ui-bundle.js, as static/swagger-ui/README.md records it.
BUNDLE_SHA256 = "e6a898692f2d768e807c3ba4626068a69a2c5dd960dd6c76f3e4d3a3de180af2"


@pytest.fixture(scope="module")
def base_url(postgres_databases: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's URL (tokens configured: read and write)."""
    with served_on_postgres(postgres_databases, tmp_path_factory.mktemp("docs")) as url:
        yield url


@pytest.fixture
def http(base_url: str) -> Iterator[httpx.Client]:
    """A client without a token that does not follow redirects."""
    with httpx.Client(base_url=base_url, follow_redirects=False, timeout=30) as client:
        yield client


def csp(response: httpx.Response) -> dict[str, list[str]]:
    """The Content-Security-Policy header as directive -> sources."""
    directives = [d.split() for d in response.headers["content-security-policy"].split(";") if d.strip()]
    return {d[0]: d[1:] for d in directives}


def assets(doc: Node) -> list[str]:
    """Every URL the page loads by itself: scripts, stylesheets, icons."""
    found = [n.attrs["src"] for n in doc.all("script") if "src" in n.attrs]
    return found + [n.attrs["href"] for n in doc.all("link")]


# -- auth -----------------------------------------------------------------------------------------


def test_docs_without_a_token_sends_a_browser_to_login(http: httpx.Client) -> None:
    response = http.get("/docs")
    assert response.status_code == 303 and response.headers["location"] == "/login?next=%2Fdocs"
    wrong = http.get("/docs", headers={"Authorization": "Bearer not-a-token-of-this-server"})
    assert wrong.status_code == 401 and wrong.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize("path", ["/redoc", "/docs/oauth2-redirect"])
def test_framework_doc_pages_are_gone(http: httpx.Client, path: str) -> None:
    assert http.get(path, headers=READ).status_code == 404


def test_openapi_json_takes_an_api_token_only(http: httpx.Client) -> None:
    nobody = http.get("/openapi.json")
    assert nobody.status_code == 401 and nobody.json()["code"] == "unauthorized"
    http.cookies.set("ckptstore_token", READ_TOKEN)
    assert http.get("/openapi.json").status_code == 401  # the page cookie is not an API token
    http.cookies.clear()
    assert http.get("/openapi.json", params={"token": READ_TOKEN}, headers=READ).status_code == 400
    spec = http.get("/openapi.json", headers=READ)
    assert spec.status_code == 200 and "/v1/shards/{shard_id}" in spec.json()["paths"]


# -- the page -------------------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["header", "cookie"])
def test_docs_is_served_from_this_server_under_a_strict_csp(http: httpx.Client, via: str) -> None:
    if via == "cookie":
        http.cookies.set("ckptstore_token", WRITE_TOKEN)
    response = http.get("/docs", headers=READ if via == "header" else {})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    policy = csp(response)
    assert policy["default-src"] == ["'none'"]
    assert policy["script-src"] == ["'self'"] and policy["style-src"] == ["'self'"]
    assert policy["connect-src"] == ["'self'"] and policy["frame-ancestors"] == ["'none'"]
    assert set(policy["img-src"]) == {"'self'", "data:"}  # Swagger UI's icons are data: images in its CSS
    sources = {s for values in policy.values() for s in values}
    assert sources <= {"'none'", "'self'", "data:"}, sources
    assert "https://" not in response.text and "http://" not in response.text
    doc = parse(response.text)
    loaded = assets(doc)
    assert {"/static/swagger-ui/swagger-ui-bundle.js", "/static/swagger-ui/swagger-ui.css", "/static/docs.js"} <= set(
        loaded
    )
    assert all(url.startswith("/static/") for url in loaded), loaded
    assert not [n for n in doc.all("script") if "src" not in n.attrs and n.attrs.get("type") != "application/json"]


def test_every_asset_the_docs_page_loads_is_served(http: httpx.Client) -> None:
    loaded = assets(parse(http.get("/docs", headers=READ).text))
    kinds = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    for url in loaded:
        response = http.get(url)  # /static needs no token, as for the other pages
        assert response.status_code == 200, url
        assert response.headers["content-type"].startswith(kinds[Path(url).suffix]), url
        assert response.content == (API / url.lstrip("/")).read_bytes()
        assert b"sourceMappingURL" not in response.content  # no reference to a map that is not shipped


def test_the_page_carries_the_schema_as_inert_data(http: httpx.Client) -> None:
    response = http.get("/docs", headers=READ)
    assert len(parse(response.text).all("script", type="application/json")) == 1
    raw_block = response.text.split('<script type="application/json" id="openapi-schema">', 1)[1].split("</script>")[0]
    spec = http.get("/openapi.json", headers=READ).json()
    assert json.loads(raw_block) == spec
    assert list(json.loads(raw_block)["paths"]) == list(spec["paths"])  # in route order, as the API lists them


def test_markup_in_the_schema_cannot_end_the_data_block(tmp_path: Path) -> None:
    hostile = "</script><script>alert(1)</script><!-- & ' \u2028"
    store = Store.open_home(tmp_path / "home")
    try:
        app = create_app(store, Settings(home=tmp_path / "home", tokens=None, host="127.0.0.1"))
        app.openapi()["info"]["description"] = hostile  # FastAPI serves the schema it cached
        with TestClient(app, base_url="http://127.0.0.1") as client:
            page = client.get("/docs").text
    finally:
        store.close()
    raw_block = page.split('<script type="application/json" id="openapi-schema">', 1)[1].split("</script>")[0]
    assert "<" not in raw_block and ">" not in raw_block and "&" not in raw_block
    assert json.loads(raw_block)["info"]["description"] == hostile


# -- shipping -------------------------------------------------------------------------------------


def test_swagger_ui_ships_in_the_wheel_with_its_license() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "ckptstore.service.api.pages"
    ]
    shipped = [p.relative_to(API).as_posix() for p in (API / "static").rglob("*") if p.is_file()]
    assert "static/swagger-ui/swagger-ui-bundle.js" in shipped and "static/docs.js" in shipped
    for name in shipped:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), f"{name} would be left out of the wheel"
    assert "Apache License" in (VENDORED / "LICENSE").read_text() and "swagger-ui" in (VENDORED / "NOTICE").read_text()
    assert hashlib.sha256((VENDORED / "swagger-ui-bundle.js").read_bytes()).hexdigest() == BUNDLE_SHA256
    assert BUNDLE_SHA256 in (VENDORED / "README.md").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY service ./service" in dockerfile and "pip install ." in dockerfile  # the image installs the wheel


# -- in a browser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium; fails (never skips) when Debian's chromium is not installed."""
    assert CHROMIUM.is_file(), f"{CHROMIUM} is missing: apt-get install chromium (.ci/run installs it)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.mark.slow  # a headless browser renders every operation
def test_docs_renders_every_operation_without_leaving_the_server(
    browser: Browser, base_url: str, tmp_path: Path
) -> None:
    operations = sum(len(ops) for ops in httpx.get(base_url + "/openapi.json", headers=READ).json()["paths"].values())
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(base_url))
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    requested: list[str] = []
    elsewhere: list[str] = []
    problems: list[str] = []

    def watch(route: Route) -> None:
        url = route.request.url
        requested.append(url)
        if url.startswith(origin + "/") or url.startswith("data:"):
            route.continue_()
        else:
            elsewhere.append(url)
            route.abort()

    context.route("**/*", watch)
    page = context.new_page()
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    try:
        page.goto(base_url + "/docs")
        page.wait_for_url(base_url + "/login?next=%2Fdocs")  # no cookie yet: log in first
        page.fill("#token", READ_TOKEN)
        page.click("button[type=submit]")
        page.wait_for_url(base_url + "/docs")
        page.locator(".opblock").nth(operations - 1).wait_for()
        assert page.locator(".opblock").count() == operations
        summaries = page.locator(".opblock-summary-path").all_inner_texts()
        assert "/v1/shards/{shard_id}" in {s.replace("\u200b", "") for s in summaries}
        page.screenshot(path=tmp_path / "docs.png")
    finally:
        context.close()
    assert elsewhere == [], elsewhere
    assert problems == [], problems  # a CSP violation would be logged as an error here
    assert any(url.endswith("/static/swagger-ui/swagger-ui-bundle.js") for url in requested)
    assert (tmp_path / "docs.png").stat().st_size > 10_000
