"""Every request of the HTTP client goes the way the proxy variables say: JSON calls, shard
uploads and ranged shard reads alike.

A real forwarding proxy on loopback (tests/client/proxy_kit.py) stands between the client and
a real uvicorn server on PostgreSQL; the server records the client port of every request and
the proxy the ports of the connections it opened, so a request that went around the proxy
shows. ``NO_PROXY`` never names 127.0.0.1 unless the test says so: loopback is not exempt.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from httpx._utils import URLPattern, get_environment_proxies

from ckptstore import client
from ckptstore.client.http.bulk import BulkHttp, HttpxBulk
from ckptstore.client.http.route import environment_proxy
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.db import Database
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from tests.backends import empty_tables
from tests.client.models import TinyNet, tensors_equal
from tests.client.proxy_kit import ClientPorts, ForwardProxy, TlsFiles, make_tls_files, serving

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
#: Credentials with characters that must be percent-encoded in the proxy URL.
USER, PASSWORD, QUOTED = "trainer", "p@ss:w0rd", "trainer:p%40ss%3Aw0rd"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment without any proxy variable, either case."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


@pytest.fixture
def app(pg_url: str, tmp_path: Path) -> Iterator[ClientPorts]:
    """The API on PostgreSQL (blobs in a local folder), emptied, recording each request's client port."""
    database = Database(pg_url)
    empty_tables(database)
    database.dispose()
    settings = Settings(home=tmp_path / "server", database_url=pg_url)
    store = open_store(settings)
    try:
        yield ClientPorts(create_app(store, settings))
    finally:
        store.close()


@pytest.fixture
def tls(tmp_path: Path, environ: pytest.MonkeyPatch) -> TlsFiles:
    """Certificates for 127.0.0.1 from a test CA the client trusts (SSL_CERT_FILE)."""
    files = make_tls_files(tmp_path)
    environ.setenv("SSL_CERT_FILE", str(files.ca))
    return files


def with_credentials(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{QUOTED}@{rest}"


def save_and_load(url: str) -> str:
    """Save a model over HTTP, load it into another with a new client; returns the wire that carried shard bytes."""
    saved, model = TinyNet(seed=3), TinyNet(seed=4)
    with client.Client(url) as ckpt:
        assert ckpt.save("run", saved, step=1).version == 1
    with client.Client(url) as ckpt:
        assert ckpt.load("run", model=model).version == 1
        assert isinstance(ckpt.transport, HttpTransport)
        wire = type(ckpt.transport.session.bulk).__name__
    expected = saved.state_dict()
    assert all(tensors_equal(value, expected[key]) for key, value in model.state_dict().items())
    return wire


def assert_all_came_through(app: ClientPorts, proxy: ForwardProxy) -> None:
    """Every request the server saw came in on a connection the proxy opened, shard bytes included."""
    assert app.requests
    assert {port for *_, port in app.requests} <= proxy.upstream_ports
    seen = {(method, path.split("/")[2]) for method, path, _, _ in app.requests}
    assert {("PUT", "shards"), ("POST", "tensors"), ("POST", "runs")} <= seen
    # Shard bytes come back by ranged GETs or, for ranges of several shards, one batched POST.
    assert {("GET", "shards"), ("POST", "shards")} & seen
    reads = [ranged for method, path, ranged, _ in app.requests if method == "GET" and path.startswith("/v1/shards/")]
    assert all(ranged and ranged.startswith("bytes=") for ranged in reads)
    assert all(asked.proxy_authorization == BASIC for asked in proxy.asked)


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
def test_a_save_and_a_load_go_through_the_proxy_the_environment_names(
    app: ClientPorts, environ: pytest.MonkeyPatch, variable: str
) -> None:
    with serving(app) as url, ForwardProxy() as proxy:
        environ.setenv(variable, with_credentials(proxy.url))
        environ.setenv("NO_PROXY", "localhost,.internal.example,10.0.0.1")
        assert save_and_load(url) == BulkHttp.__name__

    assert_all_came_through(app, proxy)
    asked = {(a.method, a.target.split("/")[4], a.range is not None) for a in proxy.asked}
    # The shard bytes themselves: uploaded, and read back by ranged GETs or one batched POST.
    assert ("PUT", "shards", False) in asked and {("GET", "shards", True), ("POST", "shards", False)} & asked
    assert ("POST", "runs", False) in asked  # the commit
    assert all(a.target.startswith(f"{url}/v1/") for a in proxy.asked)


def test_no_proxy_naming_the_server_goes_straight(app: ClientPorts, environ: pytest.MonkeyPatch) -> None:
    with serving(app) as url, ForwardProxy() as proxy:
        environ.setenv("HTTP_PROXY", proxy.url)
        environ.setenv("NO_PROXY", "example.invalid, 127.0.0.1")
        save_and_load(url)
    assert proxy.asked == [] and app.requests


def test_an_https_server_is_reached_through_a_connect_tunnel(
    app: ClientPorts, environ: pytest.MonkeyPatch, tls: TlsFiles
) -> None:
    with serving(app, tls) as url, ForwardProxy() as proxy:
        environ.setenv("HTTPS_PROXY", with_credentials(proxy.url))
        environ.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # for http:// only: never used here
        assert save_and_load(url) == BulkHttp.__name__
    assert_all_came_through(app, proxy)
    assert {(asked.method, asked.target) for asked in proxy.asked} == {("CONNECT", url.removeprefix("https://"))}


def test_an_https_server_through_an_https_proxy_sends_shard_bytes_through_httpx(
    app: ClientPorts, environ: pytest.MonkeyPatch, tls: TlsFiles
) -> None:
    with serving(app, tls) as url, ForwardProxy(tls.server_context()) as proxy:
        environ.setenv("HTTPS_PROXY", with_credentials(proxy.url))
        assert save_and_load(url) == HttpxBulk.__name__  # TLS inside TLS: not for the bulk connections
    assert_all_came_through(app, proxy)
    assert {asked.method for asked in proxy.asked} == {"CONNECT"}


def test_an_http_server_through_an_https_proxy(app: ClientPorts, environ: pytest.MonkeyPatch, tls: TlsFiles) -> None:
    with serving(app) as url, ForwardProxy(tls.server_context()) as proxy:
        environ.setenv("HTTP_PROXY", with_credentials(proxy.url))
        assert save_and_load(url) == BulkHttp.__name__
    assert_all_came_through(app, proxy)
    assert all(asked.target.startswith(f"{url}/v1/") for asked in proxy.asked)


def test_an_unreachable_proxy_is_named_without_its_credentials(environ: pytest.MonkeyPatch) -> None:
    with ForwardProxy() as proxy:
        down = proxy.url  # closed on leaving: connections to it are refused
    environ.setenv("HTTP_PROXY", with_credentials(down))
    with client.Client("http://127.0.0.1:9", retry_seconds=0) as ckpt:
        with pytest.raises(client.StorageError) as caught:
            ckpt.runs()
    assert f"the proxy {down}" in str(caught.value) and PASSWORD not in str(caught.value)


def httpx_choice(url: str) -> str | None:
    """The proxy httpx itself would use for ``url`` in this environment."""
    mounts = {URLPattern(key): value for key, value in get_environment_proxies().items()}
    return next((mounts[pattern] for pattern in sorted(mounts) if pattern.matches(httpx.URL(url))), None)


@pytest.mark.parametrize(
    ("variables", "url", "expected"),
    [
        ({}, "http://127.0.0.1:8000", None),
        ({"HTTP_PROXY": "http://p:3128"}, "http://127.0.0.1:8000", "http://p:3128"),
        ({"HTTP_PROXY": "p:3128"}, "http://store.example:8000", "http://p:3128"),
        ({"HTTP_PROXY": "http://p:3128"}, "https://store.example", None),
        ({"HTTPS_PROXY": "http://s:3128", "ALL_PROXY": "http://a:1"}, "https://store.example", "http://s:3128"),
        ({"ALL_PROXY": "http://a:1"}, "https://store.example", "http://a:1"),
        ({"http_proxy": "http://lower:1", "HTTP_PROXY": "http://upper:1"}, "http://store.example", "http://lower:1"),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "*"}, "http://store.example", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "example"}, "http://storeexample", "http://a:1"),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "store.example"}, "http://store.example", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "example"}, "http://example", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "store.example"}, "http://x.store.example", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": ".store.example"}, "http://store.example", "http://a:1"),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": ".store.example"}, "http://x.store.example", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "127.0.0.1"}, "http://127.0.0.1:8000", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "127.0.0.2"}, "http://127.0.0.1:8000", "http://a:1"),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "::1"}, "http://[::1]:8000", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "LOCALHOST"}, "http://localhost:8000", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "http://store.example:8000"}, "http://store.example:8000", None),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "http://store.example:8000"}, "http://store.example:9", "http://a:1"),
        ({"ALL_PROXY": "http://a:1", "NO_PROXY": "https://store.example"}, "http://store.example", "http://a:1"),
        ({"HTTP_PROXY": "http://p:1", "NO_PROXY": "http://"}, "http://store.example", None),
    ],
)
def test_the_proxy_is_the_one_httpx_picks(
    environ: pytest.MonkeyPatch, variables: dict[str, str], url: str, expected: str | None
) -> None:
    for name, value in variables.items():
        environ.setenv(name, value)
    assert environment_proxy(url) == expected
    assert httpx_choice(url) == expected  # the rules are httpx's, checked against httpx itself
