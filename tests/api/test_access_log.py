"""No secret reaches the server's log: a token sent every way a URL, a header or a form can carry it.

The server is ``ckptstore serve`` on PostgreSQL in a process of its own, so its log is written
with the logging set-up of the real command, access log included. Each request carries the
admin token (and a second, unknown one: a token of another server is a secret too); once the
server has stopped, neither appears anywhere in what it wrote, while the log shows it did record
those requests, query parameter names included.
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

from tests.api.kit import ADMIN_TOKEN, TOKENS
from tests.api.served_process import ServedProcess, serve_process

#: Not a token of this server, but a token all the same.
FOREIGN = "foreign-token-5e1d7c9a3b2f4e60"


def ways(token: str, known: bool) -> list[tuple[str, str, dict[str, str], bytes | None]]:
    """Requests (method, target, headers, body) each carrying ``token`` somewhere.

    Anywhere in the path only if the server ``known`` the token: an unknown one there cannot be
    told from a run id (it is in the query, a matrix parameter or after an encoded '#').
    """
    encoded = "".join(f"%{ord(c):02X}" for c in token)  # every character percent-encoded
    in_url = [
        f"/v1/runs?token={token}",
        f"/v1/runs?to%6ben={token}",
        f"/v1/runs?%74oken={token}",
        f"/v1/runs?to%256ben={token}",
        f"/v1/runs?TOKEN={token}",
        f"/v1/runs?Token={token}&page=2",
        f"/v1/runs?access_token={token}",
        f"/v1/runs?api_key={token}",
        f"/v1/runs?auth={token}",
        f"/v1/runs?bearer={token}",
        f"/v1/runs?ckptstore_token={token}",
        f"/v1/runs?x={token}",
        f"/v1/runs?{token}",
        f"/v1/runs?token={encoded}",
        f"/v1/runs;token={token}",
        f"/v1/runs%3Btoken%3D{token}",
        f"/v1/runs%23token={token}",
        f"/v1/runs/run-a%23{token}/versions",
        f"/?ckptstore_token={token}",
        f"/runs/run-a?ckptstore_token={token}&page=2",
        f"/login?next=/runs%3Fckptstore_token%3D{token}",
    ]
    if known:
        in_url += [
            f"/v1/runs/{token}/versions",
            f"/v1/runs/{encoded}/versions",
            f"/v1/runs%2F{token}",
            f"/runs/{token}",
            f"/static/{token}.css",
        ]
    requests = [("GET", target, {}, None) for target in in_url]
    requests += [
        ("GET", "/v1/runs", {"Authorization": f"Bearer {token}"}, None),
        ("GET", "/v1/runs", {"Authorization": f"bearer {token}"}, None),
        ("GET", "/", {"Cookie": f"ckptstore_token={token}"}, None),
        ("POST", "/login", {"Content-Type": "application/x-www-form-urlencoded"}, f"token={token}&next=/".encode()),
        ("POST", f"/v1/tensors/locate?token={token}", {"Content-Type": "application/json"}, b'{"digests": []}'),
    ]
    return requests


@pytest.fixture
def server(pg_url: str, tmp_path: Path) -> Iterator[ServedProcess]:
    """``ckptstore serve`` with tokens on the PostgreSQL database."""
    with serve_process(tmp_path / "home", database_url=pg_url, tokens=TOKENS) as served:
        yield served


def send(url: str, method: str, target: str, headers: dict[str, str], body: bytes | None) -> http.client.HTTPResponse:
    """One request with ``target`` sent byte for byte as given."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    connection.putrequest(method, target, skip_accept_encoding=True)
    for name, value in {**headers, **({"Content-Length": str(len(body))} if body is not None else {})}.items():
        connection.putheader(name, value)
    connection.endheaders(body)
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def test_no_token_sent_in_any_way_reaches_the_log(server: ServedProcess) -> None:
    locations = []
    statuses = []
    for token in (ADMIN_TOKEN, FOREIGN):
        for method, target, headers, body in ways(token, known=token == ADMIN_TOKEN):
            response = send(server.url, method, target, headers, body)
            statuses.append(response.status)
            locations.append(response.getheader("location") or "")
        # A request line the parser refuses, token and all.
        parts = urlsplit(server.url)
        with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
            sock.sendall(f"GET /v1/runs?token={token} HTTP/1.1 {token}\r\nHost: t\r\n\r\n".encode())
            assert sock.recv(65536).startswith(b"HTTP/1.1 400")

    assert all(status < 500 for status in statuses), statuses
    assert 303 in statuses  # the pages sent a browser without a cookie to /login ...
    for location in locations:  # ... and no redirect carries the token on
        assert ADMIN_TOKEN not in location and FOREIGN not in location, location

    server.stop()
    log = server.log.read_text(errors="replace")
    # The requests were logged, with their query parameters' names, the secret-bearing values
    # masked and the harmless ones readable.
    assert log.count('"GET /v1/runs?token=*** HTTP/1.1" 400') >= 2, log[-3000:]
    assert '"GET /v1/runs?Token=***&page=2 HTTP/1.1" 400' in log
    assert '"GET /v1/runs HTTP/1.1" 200' in log
    for secret in (ADMIN_TOKEN, FOREIGN):
        variants = {secret, quote(secret), secret.upper(), "".join(f"%{ord(c):02X}" for c in secret)}
        for variant in variants:
            assert variant not in log, f"{variant!r} is in the log:\n" + "\n".join(
                line for line in log.splitlines() if variant in line
            )
