"""What a script driving the API with curl relies on, against a real server on PostgreSQL.

A storage failure is a 503 that says only that storage is unavailable (the cause goes to the
server's log); reserved tag names are refused in any case; a JSON body sent as a form is a 415
saying how to send it; ``POST /v1/gc`` needs no body; a policy for an unknown run is a 404 that
creates nothing; a path no route matches (an id holding an encoded '/') is a 404 naming it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert

from ckptstore.service.api import create_app
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database
from ckptstore.service.db.models import Tag
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, bearer, is_json_error, raw_request, status_of
from tests.api.served import SEEDED_BODY, SEEDED_RUN, SEEDED_SHARD, ServedStore, served_store
from tests.backends import POSTGRES_URL, PostgresDatabases
from tests.servers import running_server


@pytest.fixture
def served(tmp_path: Path, postgres_databases: PostgresDatabases) -> Iterator[ServedStore]:
    """A seeded store on a fresh PostgreSQL database behind a real server."""
    with served_store("postgresql", tmp_path, postgres_databases) as running:
        yield running


def runs(served: ServedStore) -> list[str]:
    with served.client("read") as http:
        return [run["run_id"] for run in http.get("/v1/runs").json()]


# -- storage failures --------------------------------------------------------------------------


def test_a_storage_failure_is_logged_with_its_cause_and_answered_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    absent = f"ckptstore_test_absent_{uuid.uuid4().hex}"  # never created: every query fails in the driver
    url = httpx.URL(POSTGRES_URL.replace("postgresql+psycopg", "http")).copy_with(path=f"/{absent}")
    database_url = str(url).replace("http", "postgresql+psycopg", 1)
    store = Store(Database(database_url), LocalBlobStore(tmp_path / "blobs"), tmp_path / "staging")
    requests = [
        ("GET", "/v1/runs", "read", None),
        ("GET", f"/v1/runs/{SEEDED_RUN}/versions/1", "read", None),
        ("POST", f"/v1/runs/{SEEDED_RUN}/versions", "write", SEEDED_BODY),
        ("GET", "/healthz", None, None),
        ("GET", f"/runs/{SEEDED_RUN}", "read", None),
    ]
    try:
        with (
            caplog.at_level(logging.ERROR, logger="ckptstore"),
            running_server(create_app(store, Settings(home=tmp_path, tokens=TOKENS))) as base,
            httpx.Client(base_url=base, timeout=60) as http,
        ):
            answers = [http.request(m, p, headers=bearer(s) if s else {}, json=b) for m, p, s, b in requests]
    finally:
        store.close()
    for (method, path, _, _), response in zip(requests, answers, strict=True):
        assert response.status_code == 503, (method, path, response.status_code, response.text[:300])
        assert response.headers["x-error-code"] == "storage"
        for internal in (absent, "psycopg", "OperationalError", "does not exist", "sqlalchemy", "Traceback"):
            assert internal not in response.text, (path, internal)
        assert "storage is unavailable" in response.text and "retry" in response.text
        if path.startswith("/v1"):
            assert is_json_error(response)
    logged = [r for r in caplog.records if r.name.startswith("ckptstore") and r.levelno == logging.ERROR]
    assert len(logged) >= len(requests), [r.getMessage() for r in logged]
    for record in logged:
        assert record.exc_info is not None
        text = logging.Formatter().formatException(record.exc_info)
        assert absent in text and "OperationalError" in text  # the driver's cause, for the operator


# -- reserved names ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["latest", "LATEST", "Latest", "lAtEsT"])
def test_the_reserved_tag_is_refused_in_any_case_naming_it(served: ServedStore, name: str) -> None:
    with served.client("write") as http:
        tagged = http.put(f"/v1/runs/{SEEDED_RUN}/tags/{name}", json={"version": 1})
        committed = http.post(f"/v1/runs/{SEEDED_RUN}/versions", json={**SEEDED_BODY, "tags": [name]})
        versions = http.get(f"/v1/runs/{SEEDED_RUN}/versions").json()
    for response in (tagged, committed):
        assert response.status_code == 400 and is_json_error(response), response.text
        assert response.json()["code"] == "invalid_name"
        assert repr(name) in response.json()["message"] and "reserved" in response.json()["message"]
    assert [(v["version"], v["tags"]) for v in versions] == [(1, ["best"])]


def test_a_reserved_tag_made_before_the_rule_can_still_be_removed(served: ServedStore) -> None:
    with served.store.db.transaction() as session:
        session.execute(insert(Tag).values(run_id=SEEDED_RUN, name="LATEST", version=1))
    with served.client("write") as http:
        assert http.get(f"/v1/runs/{SEEDED_RUN}/refs/LATEST").json()["version"] == 1
        assert http.delete(f"/v1/runs/{SEEDED_RUN}/tags/LATEST").status_code == 204
        assert http.get(f"/v1/runs/{SEEDED_RUN}/refs/LATEST").status_code == 404


# -- JSON bodies and their content type --------------------------------------------------------

#: A valid body for every route that reads JSON; a new one fails the coverage test until listed.
JSON_BODIES: dict[tuple[str, str], tuple[str, str, dict[str, Any]]] = {
    ("POST", "/v1/tensors/missing"): ("write", "/v1/tensors/missing", {"digests": []}),
    ("POST", "/v1/tensors/locate"): ("read", "/v1/tensors/locate", {"digests": []}),
    ("POST", "/v1/tensors/sizes"): ("write", "/v1/tensors/sizes", {"sizes": [8]}),
    ("POST", "/v1/shards/ranges"): (
        "read",
        "/v1/shards/ranges",
        {"ranges": [{"shard_id": SEEDED_SHARD.shard_id, "offset": 0, "length": 8}]},
    ),
    ("POST", "/v1/shards/urls"): ("read", "/v1/shards/urls", {"shards": [SEEDED_SHARD.shard_id]}),
    ("POST", "/v1/shards/{shard_id}/uploads"): ("write", f"/v1/shards/{SEEDED_SHARD.shard_id}/uploads", {"size": 8}),
    ("POST", "/v1/shards/{shard_id}/uploads/{upload}"): (
        "write",
        f"/v1/shards/{SEEDED_SHARD.shard_id}/uploads/{'0' * 32}",
        {"size": 8},
    ),
    ("POST", "/v1/runs/{run_id}/versions"): ("write", f"/v1/runs/{SEEDED_RUN}/versions", SEEDED_BODY),
    ("PUT", "/v1/runs/{run_id}/tags/{name}"): ("write", f"/v1/runs/{SEEDED_RUN}/tags/v1", {"version": 1}),
    ("PUT", "/v1/runs/{run_id}/retention"): ("admin", f"/v1/runs/{SEEDED_RUN}/retention", {"keep_last": 3}),
    ("POST", "/v1/gc"): ("admin", "/v1/gc", {"dry_run": True}),
}


def test_every_json_route_is_covered(served: ServedStore) -> None:
    spec = create_app(served.store, Settings(home=Path("unused"))).openapi()
    reading_json = {
        (method.upper(), path)
        for path, operations in spec["paths"].items()
        for method, operation in operations.items()
        if "application/json" in operation.get("requestBody", {}).get("content", {})
    }
    assert reading_json == set(JSON_BODIES)


@pytest.mark.slow  # every JSON route x content type, each on a fresh PostgreSQL database
@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data", None]
)
@pytest.mark.parametrize("route", list(JSON_BODIES), ids=[" ".join(route) for route in JSON_BODIES])
def test_a_json_body_sent_as_another_type_is_415_saying_how_to_send_it(
    served: ServedStore, route: tuple[str, str], content_type: str | None
) -> None:
    """What ``curl -d`` sends (a form) or a bare socket sends (no type) is refused the same way on every route."""
    scope, path, body = JSON_BODIES[route]
    headers = {"Content-Type": content_type} if content_type else {}
    with served.client(scope) as http:
        response = http.request(route[0], path, content=json.dumps(body).encode(), headers=headers)
    assert response.status_code == 415 and is_json_error(response), response.text[:300]
    assert response.json()["code"] == "unsupported_media_type"
    message = response.json()["message"]
    assert (content_type or "has no Content-Type") in message and "Content-Type: application/json" in message
    assert runs(served) == [SEEDED_RUN] and len(served.store.versions(SEEDED_RUN)) == 1


@pytest.mark.slow  # every JSON route x JSON content type, each on a fresh PostgreSQL database
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8"])
@pytest.mark.parametrize("route", list(JSON_BODIES), ids=[" ".join(route) for route in JSON_BODIES])
def test_a_json_body_sent_as_json_is_read(served: ServedStore, route: tuple[str, str], content_type: str) -> None:
    scope, path, body = JSON_BODIES[route]
    with served.client(scope) as http:
        response = http.request(
            route[0], path, content=json.dumps(body).encode(), headers={"Content-Type": content_type}
        )
    if "/uploads" in route[1]:  # read and understood: a server on a local folder takes no direct uploads
        assert response.status_code == 409 and response.json()["code"] == "direct_uploads_unavailable"
        return
    assert response.status_code in (200, 201), response.text[:300]


def test_gc_needs_no_options_but_takes_them_only_as_json(served: ServedStore) -> None:
    """A body-less POST typed as a browser's "simple" request (none, a form, text) is refused: a
    cross-site page could send it without asking first."""
    with served.client("admin") as http:
        bare = http.post("/v1/gc")
        curl_d = http.post("/v1/gc", content=b"", headers={"Content-Type": "application/x-www-form-urlencoded"})
        text = http.post("/v1/gc", content=b"", headers={"Content-Type": "text/plain"})
        empty_json = http.post("/v1/gc", content=b"", headers={"Content-Type": "application/json"})
        defaults = http.post("/v1/gc", json={})
        given = http.post("/v1/gc", json={"dry_run": True, "grace_seconds": 5})
    for response in (bare, curl_d, text):
        assert response.status_code == 415 and response.json()["code"] == "unsupported_media_type", response.text
        assert "application/json" in response.json()["message"]
    for response in (empty_json, defaults):
        assert response.status_code == 200, response.text
        report = response.json()
        assert (report["dry_run"], report["grace_seconds"], report["shards_swept"]) == (False, 3600, 0)
    assert given.status_code == 200 and (given.json()["dry_run"], given.json()["grace_seconds"]) == (True, 5)
    assert len(served.store.versions(SEEDED_RUN)) == 1


# -- unknown runs, unknown paths, messages -----------------------------------------------------


def test_a_policy_for_an_unknown_run_is_404_and_creates_nothing(served: ServedStore) -> None:
    with served.client("admin") as http:
        refused = http.put("/v1/runs/typo-run/retention", json={"keep_last": 2})
        assert refused.status_code == 404 and is_json_error(refused), refused.text
        assert "'typo-run'" in refused.json()["message"]
        assert runs(served) == [SEEDED_RUN]
        assert http.get("/v1/runs/typo-run/retention").status_code == 404
        made = http.put("/v1/runs/new-run/retention", params={"create": "true"}, json={"keep_last": 2})
        assert made.status_code == 200 and made.json()["keep_last"] == 2
        assert sorted(runs(served)) == ["new-run", SEEDED_RUN]
        kept = http.put(f"/v1/runs/{SEEDED_RUN}/retention", json={"keep_last": 4})
        assert kept.status_code == 200 and kept.json()["keep_last"] == 4


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/runs/a%2Fb/versions"),
        ("GET", "/v1/runs/a%2fb/versions"),
        ("GET", f"/v1/runs/{SEEDED_RUN}/versions/1%2F2"),
        ("GET", f"/v1/runs/{SEEDED_RUN}/refs/a%2Fb"),
        ("PUT", f"/v1/runs/{SEEDED_RUN}/tags/a%2Fb"),
        ("PUT", "/v1/runs/a%2Fb/retention"),
        ("DELETE", f"/v1/runs/{SEEDED_RUN}/versions/..%2F..%2Fx"),
    ],
)
def test_an_id_holding_an_encoded_slash_is_a_404_naming_the_problem(
    served: ServedStore, method: str, path: str
) -> None:
    body = b'{"version": 1}' if method == "PUT" else b""
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bearer('admin')['Authorization'][7:]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    answer = raw_request(served.url, request)
    assert status_of(answer) == 404, answer[:300]
    payload = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert payload["code"] == "not_found"
    assert "%2F" in payload["message"] and "'/'" in payload["message"] and path in payload["message"]


def test_a_path_no_route_matches_is_a_404_naming_it(served: ServedStore) -> None:
    with served.client("read") as http:
        response = http.get("/v1/nothing-here")
    assert response.status_code == 404 and is_json_error(response)
    assert "GET '/v1/nothing-here'" in response.json()["message"]


def test_a_token_of_too_small_a_scope_is_told_which_it_needs(served: ServedStore) -> None:
    with served.client("write") as http:
        admin_only = http.delete(f"/v1/runs/{SEEDED_RUN}/versions/1")
    with served.client("read") as http:
        write_only = http.post("/v1/tensors/missing", json={"digests": []})
    assert admin_only.status_code == 403 and "needs an admin token; yours is write" in admin_only.json()["message"]
    assert write_only.status_code == 403 and "needs a write token; yours is read" in write_only.json()["message"]
