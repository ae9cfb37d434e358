"""The auth matrix: every /v1 route × {no token, read, write, admin}, and the edges of the header.

The routes are enumerated from the app itself, and a test checks they are exactly the ones in
ROUTE_SCOPES, so a new route cannot escape the matrix: it fails until its scope is written down.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.api.deps import ScopeCheck
from ckptstore.service.api.server import http_protocol
from ckptstore.service.errors import AuthenticationError
from ckptstore.service.format.manifest import validate_body
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import (
    ADMIN_TOKEN,
    READ_TOKEN,
    TOKEN_OF,
    WRITE_TOKEN,
    Served,
    bearer,
    build_shard,
    commit_body,
    entry,
    is_json_error,
    stored_blobs,
    tensor,
)

#: The scope each /v1 route needs: the specification the matrix checks the server against.
ROUTE_SCOPES = {
    ("POST", "/v1/tensors/missing"): "write",
    ("POST", "/v1/tensors/locate"): "read",
    ("POST", "/v1/tensors/sizes"): "write",
    ("PUT", "/v1/shards/{shard_id}"): "write",
    ("POST", "/v1/shards"): "write",
    ("GET", "/v1/shards/{shard_id}"): "read",
    ("HEAD", "/v1/shards/{shard_id}"): "read",
    ("POST", "/v1/shards/ranges"): "read",
    ("POST", "/v1/shards/urls"): "read",
    ("POST", "/v1/shards/{shard_id}/uploads"): "write",
    ("POST", "/v1/shards/{shard_id}/uploads/{upload}"): "write",
    ("DELETE", "/v1/shards/{shard_id}/uploads/{upload}"): "write",
    ("GET", "/v1/runs"): "read",
    ("GET", "/v1/runs/{run_id}/versions"): "read",
    ("POST", "/v1/runs/{run_id}/versions"): "write",
    ("GET", "/v1/runs/{run_id}/versions/{ref}"): "read",
    ("GET", "/v1/runs/{run_id}/versions/{ref}/metadata-check"): "read",
    ("DELETE", "/v1/runs/{run_id}/versions/{ref}"): "admin",
    ("GET", "/v1/runs/{run_id}/refs/{ref}"): "read",
    ("PUT", "/v1/runs/{run_id}/tags/{name}"): "write",
    ("DELETE", "/v1/runs/{run_id}/tags/{name}"): "write",
    ("GET", "/v1/runs/{run_id}/retention"): "read",
    ("PUT", "/v1/runs/{run_id}/retention"): "admin",  # a policy deletes versions, as DELETE does
    ("POST", "/v1/runs/{run_id}/retention/apply"): "admin",
    ("POST", "/v1/gc"): "admin",  # collection deletes bytes
}
JSON = {"Content-Type": "application/json"}
RANK = {None: 0, "read": 1, "write": 2, "admin": 3}
CALLERS = [None, "read", "write", "admin"]

SHARD = build_shard(tensor(1), tensor(2))
from ckptstore.service.format.sharding import encode_layout  # noqa: E402

PARAMS = {"shard_id": SHARD.shard_id, "run_id": "run-a", "ref": "1", "name": "best", "upload": "0" * 32}
#: Routes a server on a local folder answers 409 (direct_uploads_unavailable) once the caller may use them.
NEEDS_S3 = {"/v1/shards/{shard_id}/uploads", "/v1/shards/{shard_id}/uploads/{upload}"}
BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/tensors/missing"): {"json": {"digests": SHARD.digests}},
    ("POST", "/v1/tensors/locate"): {"json": {"digests": SHARD.digests}},
    ("PUT", "/v1/shards/{shard_id}"): {"content": SHARD.data},
    ("POST", "/v1/shards"): {"content": encode_layout([("U8", (4,))]) + b"abcd"},
    ("POST", "/v1/tensors/sizes"): {"json": {"sizes": [8]}},
    ("POST", "/v1/shards/ranges"): {"json": {"ranges": [{"shard_id": SHARD.shard_id, "offset": 0, "length": 8}]}},
    ("POST", "/v1/shards/urls"): {"json": {"shards": [SHARD.shard_id]}},
    ("POST", "/v1/shards/{shard_id}/uploads"): {"json": {"size": len(SHARD.data)}},
    ("POST", "/v1/shards/{shard_id}/uploads/{upload}"): {"json": {"size": len(SHARD.data)}},
    ("POST", "/v1/runs/{run_id}/versions"): {"json": commit_body(entry("model/w", SHARD.tensors[0]))},
    ("PUT", "/v1/runs/{run_id}/tags/{name}"): {"json": {"version": 1}},
    ("PUT", "/v1/runs/{run_id}/retention"): {"json": {"keep_last": 5}},
    ("POST", "/v1/gc"): {"json": {"dry_run": True}},
}


def api_routes(app: FastAPI) -> Iterator[tuple[str, str, APIRoute]]:
    """Every (method, path, route) of the app under /v1.

    FastAPI 0.165 keeps included routers as ``_IncludedRouter`` entries in ``app.routes``, so a
    plain ``isinstance(route, APIRoute)`` filter over ``app.routes`` finds nothing;
    ``iter_route_contexts`` walks into them and gives each route's full path.
    """
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute) and (context.path or "").startswith("/v1"):
            for method in sorted(context.methods or ()):
                yield method, str(context.path), route


def in_safe_order(routes: Iterator[tuple[str, str, APIRoute]]) -> list[tuple[str, str, APIRoute]]:
    """Deletes last, a version's after a tag's: deleting version 1 takes its tags and its reads away."""
    return sorted(routes, key=lambda r: (r[0] == "DELETE", "/versions/" in r[1]))


def url_for(path: str) -> str:
    """The route's path with valid parameters filled in (KeyError names a new parameter)."""
    return path.format(**PARAMS)


def seed(store: Store) -> None:
    """A run 'run-a' with version 1 tagged 'best', so every sufficient-scope request can succeed."""
    path = store.staging_path()
    path.write_bytes(SHARD.data)
    store.ingest_file(path)
    store.commit("run-a", validate_body(commit_body(entry("model/w", SHARD.tensors[0]))["manifest"]), tags=["best"])


def test_the_matrix_covers_exactly_the_app_routes(app: FastAPI) -> None:
    found = {(method, path) for method, path, _ in api_routes(app)}
    assert found, "no /v1 routes found: the enumeration is broken and the matrix would pass vacuously"
    assert found == set(ROUTE_SCOPES), "a /v1 route was added or removed: write its scope into ROUTE_SCOPES"
    openapi = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops if p.startswith("/v1")}
    assert openapi == found


def test_every_route_declares_the_scope_of_the_table(app: FastAPI) -> None:
    for method, path, route in api_routes(app):
        checks = [d.dependency for d in route.dependencies if isinstance(d.dependency, ScopeCheck)]
        assert [c.scope for c in checks] == [ROUTE_SCOPES[method, path]], (method, path)


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c or "no-token")
def test_auth_matrix(app: FastAPI, store: Store, client: TestClient, caller: str | None) -> None:
    seed(store)
    headers = bearer(caller) if caller else {}
    wrong = []
    for method, path, _route in in_safe_order(api_routes(app)):
        needed = ROUTE_SCOPES[method, path]
        response = client.request(method, url_for(path), headers=headers, **BODIES.get((method, path), {}))
        status, code = response.status_code, response.headers.get("x-error-code")
        if caller is None:
            ok = status == 401 and code == "unauthorized" and response.headers.get("www-authenticate") == "Bearer"
        elif RANK[caller] < RANK[needed]:
            ok = status == 403 and code == "forbidden" and "www-authenticate" not in response.headers
        elif path in NEEDS_S3:
            ok = status == 409 and code == "direct_uploads_unavailable"
        else:
            ok = status < 400
        # A HEAD answer has no body to hold the JSON error; its status and X-Error-Code still say it.
        if not ok or (status >= 400 and method != "HEAD" and not is_json_error(response)):
            wrong.append(f"{method} {path} as {caller or 'nobody'} (needs {needed}): {status} {response.text[:120]}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "body",
    [b"[[[[", b"{" * 100_000, b'{"digests": [NaN]}', b"x" * 200_000],
    ids=["broken", "deep", "nan", "oversized"],
)
def test_no_token_is_refused_before_the_body_is_read(client: TestClient, body: bytes) -> None:
    """Without a token the answer is 401, whatever the body: it is never buffered or parsed."""
    for path in ("/v1/tensors/missing", "/v1/tensors/locate", "/v1/runs/run-a/versions"):
        response = client.post(path, content=body, headers=JSON)
        assert response.status_code == 401, (path, response.text)
    response = client.put("/v1/runs/run-a/tags/best", content=body, headers=JSON)
    assert response.status_code == 401


def test_a_lower_scope_is_refused_before_the_body_is_read(client: TestClient) -> None:
    response = client.post("/v1/tensors/missing", content=b"[[[[", headers={**bearer("read"), **JSON})
    assert response.status_code == 403


def test_no_token_upload_stores_nothing(client: TestClient, home: Path) -> None:
    response = client.put(f"/v1/shards/{SHARD.shard_id}", content=SHARD.data)
    assert response.status_code == 401
    assert stored_blobs(home) == []
    missing = client.post("/v1/tensors/missing", json={"digests": SHARD.digests}, headers=bearer("write"))
    assert missing.json() == {"missing": SHARD.digests}


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_the_scheme_is_case_insensitive(client: TestClient, scheme: str) -> None:
    response = client.get("/v1/runs", headers={"Authorization": f"{scheme} {READ_TOKEN}"})
    assert response.status_code == 200
    assert response.json() == []


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer",
        "Bearer ",
        "Bearer    ",
        "",
        "Basic " + READ_TOKEN,
        READ_TOKEN,
        "Token " + READ_TOKEN,
        "Bearer " + READ_TOKEN[:-1],
        "Bearer " + READ_TOKEN + "x",
        "Bearer " + READ_TOKEN.upper(),
        "Bearer " + "x" * 20,
        "Bearer " + "x" * 513,
        f"Bearer {READ_TOKEN},{WRITE_TOKEN}",
        "Bearer\t" + READ_TOKEN,
    ],
)
def test_missing_malformed_or_unknown_tokens_get_401(client: TestClient, authorization: str) -> None:
    response = client.get("/v1/runs", headers={"Authorization": authorization})
    assert response.status_code == 401, response.text
    assert response.headers["x-error-code"] == "unauthorized"
    assert response.headers["www-authenticate"] == "Bearer"
    assert is_json_error(response)


def test_a_megabyte_token_is_refused_not_a_crash(client: TestClient, server: Served) -> None:
    huge = "Bearer " + "a" * (1 << 20)
    response = client.get("/v1/runs", headers={"Authorization": huge})
    assert response.status_code == 431 and response.headers["x-error-code"] == "payload_too_large"
    assert huge[7:100] not in response.text
    with server.client() as http:
        over_the_wire = http.get("/v1/runs", headers={"Authorization": huge})
    assert 400 <= over_the_wire.status_code < 500


@pytest.mark.parametrize("name", ["token", "access_token", "TOKEN", "Access_Token", "api_key", "apikey", "key"])
@pytest.mark.parametrize("scope", ["read", "admin"])
def test_a_token_in_the_query_string_is_refused_even_with_a_valid_header(
    client: TestClient, name: str, scope: str
) -> None:
    response = client.get("/v1/runs", params={name: TOKEN_OF[scope]}, headers=bearer("admin"))
    assert response.status_code == 400
    assert response.headers["x-error-code"] == "invalid_input"
    assert TOKEN_OF[scope] not in response.text
    # Also on a write route, where the body would otherwise be read.
    post = client.post("/v1/tensors/missing", params={name: "x"}, json={"digests": []}, headers=bearer("admin"))
    assert post.status_code == 400


@pytest.mark.parametrize("path", ["/healthz", "/metrics"])
def test_health_and_metrics_need_no_token(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 200
    assert client.get(path, headers={"Authorization": "Bearer nonsense-nonsense"}).status_code == 200


def test_without_tokens_on_loopback_everything_is_open(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "open", host="127.0.0.1", tokens=None)
    store = Store.open_home(settings.home_path)
    try:
        seed(store)
        app = create_app(store, settings)
        with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
            answers = {
                (m, p): client.request(m, url_for(p), **BODIES.get((m, p), {})).status_code
                for m, p, _ in in_safe_order(api_routes(app))
            }
        assert len(answers) == len(ROUTE_SCOPES)
        assert all(status < 400 or (p in NEEDS_S3 and status == 409) for (_, p), status in answers.items()), answers
    finally:
        store.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_no_tokens_off_loopback_refuses_to_start(tmp_path: Path, host: str) -> None:
    store = Store.open_home(tmp_path / "h")
    try:
        with pytest.raises(AuthenticationError, match="without tokens"):
            create_app(store, Settings(home=tmp_path / "h", host=host, tokens=None))
        # With tokens the same host is fine.
        create_app(store, Settings(home=tmp_path / "h", host=host, tokens=f"read:{READ_TOKEN}"))
    finally:
        store.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_no_tokens_on_loopback_starts(tmp_path: Path, host: str) -> None:
    store = Store.open_home(tmp_path / "h")
    try:
        app = create_app(store, Settings(home=tmp_path / "h", host=host, tokens=None))
        with TestClient(app, base_url="http://127.0.0.1") as client:
            assert client.get("/v1/runs").status_code == 200
    finally:
        store.close()


def test_tokens_never_appear_in_responses_or_logs(
    app: FastAPI, store: Store, client: TestClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    seed(store)
    unknown = "unknown-token-9d8e7f6a5b4c3d2e"

    def crash() -> None:
        raise RuntimeError("the database caught fire")

    monkeypatch.setattr(store, "runs", crash)
    responses = [
        client.get("/v1/runs", headers={"Authorization": f"Bearer {unknown}"}),  # 401
        client.delete("/v1/runs/run-a/versions/1", headers=bearer("write")),  # 403
        client.get("/v1/runs/run-a/versions", params={"token": ADMIN_TOKEN}),  # 400
        client.get("/v1/runs/run-a/versions", params={"access_token": WRITE_TOKEN}, headers=bearer("read")),
        client.get("/v1/runs", headers=bearer("read")),  # 500, logged with its traceback
        client.post("/v1/tensors/missing", content=b"{", headers={**bearer("write"), **JSON}),  # 400
    ]
    assert [r.status_code for r in responses] == [401, 403, 400, 400, 500, 400]
    # The test client logs every URL it requests, query string included; that is the caller's
    # own log. Everything else was logged by the server side.
    server_log = "\n".join(
        f"{r.getMessage()} {r.exc_text or ''} {r.args!r}" for r in caplog.records if not r.name.startswith("httpx")
    )
    assert "the database caught fire" in server_log  # the log did capture the failures
    for secret in (unknown, READ_TOKEN, WRITE_TOKEN, ADMIN_TOKEN):
        for response in responses:
            assert secret not in response.text
            assert all(secret not in value for value in response.headers.values())
        assert secret not in server_log


def test_query_string_tokens_are_masked_in_the_servers_access_log(
    app: FastAPI, caplog: pytest.LogCaptureFixture
) -> None:
    """A real uvicorn with its access log on: the refused URL is logged, its token masked."""
    for name in ("uvicorn", "uvicorn.access", "uvicorn.error"):
        caplog.set_level(logging.INFO, logger=name)  # restored when the test ends
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    # log_config=None: uvicorn leaves logging alone, so its records reach caplog through the root.
    config = uvicorn.Config(
        app, log_config=None, log_level="info", access_log=True, lifespan="off", http=http_protocol()
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=30) as http:
            refused = http.get("/v1/runs", params={"token": ADMIN_TOKEN, "access_token": WRITE_TOKEN})
            unknown = http.get("/v1/runs", headers={"Authorization": f"Bearer {READ_TOKEN}x"})
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert (refused.status_code, unknown.status_code) == (400, 401)
    access = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert any("/v1/runs?token=***&access_token=***" in line and "400" in line for line in access), access
    assert any("/v1/runs" in line and "401" in line for line in access), access
    for secret in (ADMIN_TOKEN, WRITE_TOKEN, READ_TOKEN):
        assert secret not in caplog.text
