"""Size limits and names that tests/api/test_hostile.py does not reach.

- A manifest of a million entries is refused with one short error (413 past ``max_json_bytes``,
  else 422), and so are objects with hundreds of thousands of unknown fields: validation stops at
  the first bad entry instead of describing every one (which took a minute and 7 GB before).
- Run ids and tags are ASCII: look-alikes, other normalization forms and invisible characters
  are refused, and names differing only in case are different runs.
- Oversized and numerous request headers never crash the server or get a 5xx.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, bearer, build_shard, commit_body, entry, is_json_error, raw_request, status_of, tensor
from tests.servers import running_server

WRITE = {**bearer("write"), "Content-Type": "application/json"}
ADMIN = bearer("admin")
SHARD = build_shard(tensor(21, "F32", (4, 4)))
GOOD_ENTRY = entry("model/w", SHARD.tensors[0])
MILLION = 1_000_000


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A store holding one shard, so a commit of ``GOOD_ENTRY`` succeeds."""
    opened = Store.open_home(tmp_path / "home")
    path = opened.staging_path()
    path.write_bytes(SHARD.data)
    opened.ingest_file(path)
    try:
        yield opened
    finally:
        opened.close()


def app_client(store: Store, **settings: Any) -> TestClient:
    app = create_app(store, Settings(home=store.staging_dir.parent, tokens=TOKENS, **settings))
    return TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1")


def many(item: bytes, count: int = MILLION) -> bytes:
    return b",".join([item] * count)


def unknown_keys(count: int) -> bytes:
    return b",".join(b'"x%d":0' % i for i in range(count))


def assert_refused(response: Any, status: int | tuple[int, ...]) -> None:
    allowed = (status,) if isinstance(status, int) else status
    assert response.status_code in allowed, (response.status_code, response.text[:300])
    assert is_json_error(response), response.text[:300]
    # One problem, not a list of every bad item ("…; (and 999992 more)"): building that list is
    # what cost the time and memory.
    assert "more)" not in response.json()["message"], response.text[:300]


def test_a_manifest_of_a_million_entries_over_the_body_limit_is_413(store: Store) -> None:
    body = b'{"manifest": {"tensors": [' + many(b"{}") + b"]}}"
    assert len(body) > 1 << 20
    with app_client(store, max_json_bytes=1 << 20) as http:
        assert_refused(http.post("/v1/runs/run-a/versions", content=body, headers=WRITE), 413)
    assert store.runs() == []


@pytest.mark.slow  # a million-entry manifest
def test_a_manifest_of_a_million_bad_entries_within_the_limit_is_one_short_422(store: Store) -> None:
    # 16 bytes an entry, the most objects a commit may hold for its size (denser bodies are refused
    # before they are parsed: service/api/http/body_limits.py); 16 MB, so the limit is raised to parse it.
    body = b'{"manifest": {"tensors": [' + many(b'{"key": "x/00"}') + b"]}}"
    with app_client(store, max_json_bytes=32 << 20) as http:
        response = http.post("/v1/runs/run-a/versions", content=body, headers=WRITE)
    assert_refused(response, 422)
    assert "tensors/0/" in response.json()["message"] and "tensors/1/" not in response.json()["message"]
    assert store.runs() == []


@pytest.mark.slow  # bodies of 200,000 fields
@pytest.mark.parametrize(
    "body",
    [
        b'{"manifest": {"tensors": []}, ' + unknown_keys(200_000) + b"}",
        b'{"manifest": {"tensors": [], ' + unknown_keys(200_000) + b"}}",
        b'{"manifest": {"tensors": [{' + unknown_keys(200_000) + b"}]}}",
        b'{"manifest": {"tensors": [], "state": {' + unknown_keys(200_000) + b"}}}",
        b'{"manifest": {"tensors": [], "metrics": {' + unknown_keys(200_000).replace(b":0", b':"a"') + b"}}}",
        b'{"digests": [' + many(b"0", 100_000) + b"]}",
        b'{"digests": [], ' + unknown_keys(200_000) + b"}",
    ],
    ids=["commit-top", "manifest", "entry", "state-sections", "metrics", "digests", "digest-list-top"],
)
def test_hundreds_of_thousands_of_bad_fields_are_one_short_error(store: Store, body: bytes) -> None:
    route = "/v1/tensors/missing" if body.startswith(b'{"digests"') else "/v1/runs/run-a/versions"
    with app_client(store) as http:
        assert_refused(http.post(route, content=body, headers=WRITE), (400, 422))
    assert store.runs() == []


LOOKALIKES = {
    "cyrillic-a": "run-\u0430",
    "fullwidth-a": "run-\uff41",
    "nfc-e-acute": "caf\u00e9",
    "nfd-e-combining-acute": "cafe\u0301",
    "angstrom-sign": "\u212bngstrom",
    "fi-ligature": "\ufb01le",
    "zero-width-space": "run\u200b-a",
    "dotted-capital-i": "RUN-\u0130",
    "kelvin-sign": "\u212a-run",
    "mathematical-bold-r": "\U0001d42bun-a",
}


@pytest.mark.parametrize("name", list(LOOKALIKES.values()), ids=list(LOOKALIKES))
def test_run_ids_and_tags_are_ascii_so_lookalikes_are_refused(store: Store, name: str) -> None:
    with app_client(store) as http:
        assert http.post("/v1/runs/run-a/versions", json=commit_body(GOOD_ENTRY), headers=WRITE).status_code == 201
        encoded = quote(name, safe="")
        refused = [
            http.post(f"/v1/runs/{encoded}/versions", json=commit_body(GOOD_ENTRY), headers=WRITE),
            http.get(f"/v1/runs/{encoded}/versions", headers=ADMIN),
            http.post("/v1/runs/run-a/versions", json=commit_body(GOOD_ENTRY, tags=[name]), headers=WRITE),
            http.put(f"/v1/runs/run-a/tags/{encoded}", json={"version": 1}, headers=ADMIN),
            http.get(f"/v1/runs/run-a/refs/{encoded}", headers=ADMIN),
        ]
        for response in refused:
            assert_refused(response, (400, 422))
        assert [run.run_id for run in store.runs()] == ["run-a"]
        assert [v.tags for v in store.versions("run-a")] == [[]]


def test_run_ids_differing_only_in_case_are_different_runs(store: Store) -> None:
    with app_client(store) as http:
        assert http.post("/v1/runs/run-a/versions", json=commit_body(GOOD_ENTRY), headers=WRITE).status_code == 201
        assert_refused(http.get("/v1/runs/RUN-A/versions", headers=ADMIN), 404)
        assert http.post("/v1/runs/Run-A/versions", json=commit_body(GOOD_ENTRY), headers=WRITE).status_code == 201
    assert sorted(run.run_id for run in store.runs()) == ["Run-A", "run-a"]
    assert [v.version for v in store.versions("Run-A")] == [1]


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Filler", "a" * (100 << 10))],
        [("X-Filler", "a" * (1 << 20))],
        [(f"X-Filler-{i}", "a" * 64) for i in range(2000)],
        [("Cookie", "; ".join(f"c{i}=v" for i in range(20_000)))],
    ],
    ids=["one-100KB-header", "one-1MB-header", "2000-headers", "20000-cookies"],
)
def test_oversized_headers_never_get_a_5xx_and_the_server_keeps_serving(
    store: Store, headers: list[tuple[str, str]]
) -> None:
    app = create_app(store, Settings(home=store.staging_dir.parent, tokens=TOKENS))
    with running_server(app) as url:
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers)
        request = f"GET /v1/runs HTTP/1.1\r\nHost: test\r\nAuthorization: {ADMIN['Authorization']}\r\n{lines}"
        answer = raw_request(url, (request + "Connection: close\r\n\r\n").encode())
        assert answer and status_of(answer) < 500, answer[:300]
        with httpx.Client(base_url=url, headers=ADMIN) as http:
            assert http.get("/v1/runs").status_code == 200


def test_headers_over_64_kib_are_refused_with_431(store: Store) -> None:
    app = create_app(store, Settings(home=store.staging_dir.parent, tokens=TOKENS))
    with running_server(app) as url, httpx.Client(base_url=url, headers=ADMIN) as http:
        refused = http.get("/v1/runs", headers={"X-Padding": "p" * (100 << 10)})
        assert refused.status_code == 431 and refused.json()["code"] == "payload_too_large"
        assert http.get("/v1/runs", headers={"X-Padding": "p" * (8 << 10)}).status_code == 200
