"""Behaviour of the API: ranged downloads, tag and version flows, OpenAPI, metrics, health, and
the X-Error-Code contract that turns every error back into its exception class in the client."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient

from ckptstore.client.http.errors import raise_for_error
from ckptstore.service import __version__, errors
from ckptstore.service.api import create_app
from ckptstore.service.api.errors import STORAGE_MESSAGE
from ckptstore.service.api.http.socket_body import MIN_BODY_BYTES
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database
from ckptstore.service.db.reserve import SpaceReserve
from ckptstore.service.errors import CheckpointError, error_class_for_code
from ckptstore.service.format.digest import shard_id
from ckptstore.service.format.safetensors_header import header_bytes
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import Served, Shard, bearer, build_shard, commit_body, entry, tensor
from tests.servers import running_server

ADMIN = bearer("admin")
BIG = build_shard(tensor(1, "F32", (700, 1000)), tensor(2, "U8", (123_457,)))  # ~2.9 MB, odd length
SMALL = build_shard(tensor(3, "F32", (4, 4)), tensor(4, "I64", (3,)))


@pytest.fixture
def http(server: Served) -> Iterator[httpx.Client]:
    with server.client(headers=ADMIN) as client:
        yield client


def upload(http: httpx.Client | TestClient, shard: Shard) -> None:
    response = http.put(f"/v1/shards/{shard.shard_id}", content=shard.data, headers=ADMIN)
    assert response.status_code == 201, response.text


# -- ranged download --------------------------------------------------------------------------


def test_a_whole_shard_streams_back_byte_for_byte(http: httpx.Client) -> None:
    upload(http, BIG)
    with http.stream("GET", f"/v1/shards/{BIG.shard_id}") as response:
        assert response.status_code == 200
        assert response.headers["content-length"] == str(len(BIG.data))
        assert response.headers["accept-ranges"] == "bytes"
        assert response.headers["content-type"] == "application/octet-stream"
        assert "content-range" not in response.headers
        pieces = list(response.iter_raw())
    assert b"".join(pieces) == BIG.data
    assert len(pieces) > 1  # streamed, not sent as one buffer


@pytest.mark.parametrize(
    ("header", "start", "end"),
    [
        ("bytes=0-0", 0, 0),
        ("bytes=0-99", 0, 99),
        ("bytes=1000-1999999", 1000, 1999999),
        (f"bytes={len(BIG.data) - 1}-{len(BIG.data) - 1}", len(BIG.data) - 1, len(BIG.data) - 1),
        ("bytes=2000000-", 2000000, len(BIG.data) - 1),
        (f"bytes=5-{len(BIG.data) + 10_000}", 5, len(BIG.data) - 1),  # an end past the shard is clipped
    ],
)
def test_a_byte_range_is_206_with_exactly_those_bytes(http: httpx.Client, header: str, start: int, end: int) -> None:
    upload(http, BIG)
    response = http.get(f"/v1/shards/{BIG.shard_id}", headers={"Range": header})
    assert response.status_code == 206
    assert response.headers["content-range"] == f"bytes {start}-{end}/{len(BIG.data)}"
    assert response.headers["content-length"] == str(end - start + 1)
    assert response.content == BIG.data[start : end + 1]


@pytest.mark.parametrize(
    "header",
    ["bytes=5", "bytes=--5", "bytes=a-b", "items=0-5", "bytes=0-1,4-5", "bytes=9-3", "bytes 0-5", "bytes=0-" + "9" * 20,
     "bytes=" + "1" * 20 + "-", "", "bytes=0x10-0x20", "bytes=５-６".encode()],
)  # fmt: skip
def test_a_malformed_range_is_400(http: httpx.Client, header: str | bytes) -> None:
    upload(http, SMALL)
    response = http.get(f"/v1/shards/{SMALL.shard_id}", headers={"Range": header})
    assert response.status_code == 400, (header, response.status_code)
    assert response.headers["x-error-code"] == "invalid_input"


@pytest.mark.parametrize("start", [0, 1, 10**6, 10**18])
def test_a_range_starting_past_the_end_is_4xx(http: httpx.Client, start: int) -> None:
    upload(http, SMALL)
    size = len(SMALL.data)
    response = http.get(f"/v1/shards/{SMALL.shard_id}", headers={"Range": f"bytes={size + start}-"})
    assert 400 <= response.status_code < 500
    assert response.json()["code"] == response.headers["x-error-code"]


def test_an_absent_shard_is_404(http: httpx.Client) -> None:
    response = http.get(f"/v1/shards/{SMALL.shard_id}", headers={"Range": "bytes=0-1"})
    assert response.status_code == 404
    assert response.headers["x-error-code"] == "not_found"


def test_a_second_upload_of_a_shard_is_200_not_created(http: httpx.Client) -> None:
    first = http.put(f"/v1/shards/{SMALL.shard_id}", content=SMALL.data)
    second = http.put(f"/v1/shards/{SMALL.shard_id}", content=SMALL.data)
    assert (first.status_code, first.json()["created"]) == (201, True)
    assert (second.status_code, second.json()["created"]) == (200, False)
    assert first.json()["size"] == second.json()["size"] == len(SMALL.data)
    assert first.json()["tensors"] == 2


# -- runs, versions, tags ---------------------------------------------------------------------


def test_commit_tag_resolve_untag_delete(client: TestClient) -> None:
    upload(client, SMALL)
    a, b = SMALL.tensors
    run = "/v1/runs/run-a"
    one = client.post(f"{run}/versions", json=commit_body(entry("model/a", a), step=10), headers=ADMIN)
    two = client.post(
        f"{run}/versions", json=commit_body(entry("model/a", a), entry("extra/b", b), step=20), headers=ADMIN
    )
    assert (one.status_code, one.json()["version"], one.json()["parent"]) == (201, 1, None)
    assert (two.status_code, two.json()["version"], two.json()["parent"]) == (201, 2, 1)
    assert (two.json()["tensors_total"], two.json()["tensors_new"]) == (2, 1)

    def resolve(ref: str) -> httpx.Response:
        return client.get(f"{run}/refs/{ref}", headers=ADMIN)

    assert resolve("latest").json() == {"run_id": "run-a", "version": 2}
    assert resolve("1").json()["version"] == 1
    tagged = client.put(f"{run}/tags/best", json={"version": 1}, headers=ADMIN)
    assert tagged.json() == {"run_id": "run-a", "version": 1}
    assert resolve("best").json()["version"] == 1
    assert client.put(f"{run}/tags/newest", json={"version": "latest"}, headers=ADMIN).json()["version"] == 2
    assert client.put(f"{run}/tags/same", json={"version": "best"}, headers=ADMIN).json()["version"] == 1
    listed = client.get(f"{run}/versions", headers=ADMIN).json()
    assert [(v["version"], v["tags"], v["step"]) for v in listed] == [(1, ["best", "same"], 10), (2, ["newest"], 20)]
    # Moving a tag.
    assert client.put(f"{run}/tags/best", json={"version": 2}, headers=ADMIN).json()["version"] == 2
    assert resolve("best").json()["version"] == 2
    # Refused tag names and references.
    assert client.put(f"{run}/tags/latest", json={"version": 1}, headers=ADMIN).status_code == 400
    assert client.put(f"{run}/tags/1abc", json={"version": 1}, headers=ADMIN).status_code == 400
    assert client.put(f"{run}/tags/x", json={"version": 9}, headers=ADMIN).status_code == 404
    assert client.put(f"{run}/tags/x", json={"version": 0}, headers=ADMIN).status_code == 422
    assert client.put(f"{run}/tags/x", json={"version": True}, headers=ADMIN).status_code == 422
    # The manifest of a tagged version.
    manifest = client.get(f"{run}/versions/same", headers=ADMIN)
    assert manifest.status_code == 200
    assert manifest.headers["content-type"] == "application/json"
    assert (manifest.json()["run_id"], manifest.json()["version"], manifest.json()["step"]) == ("run-a", 1, 10)
    assert [t["key"] for t in manifest.json()["tensors"]] == ["model/a"]
    # Untag.
    assert client.delete(f"{run}/tags/best", headers=ADMIN).status_code == 204
    assert resolve("best").status_code == 404
    assert client.delete(f"{run}/tags/best", headers=ADMIN).status_code == 404
    # Delete a version: its tags go with it, numbers are never reused.
    deleted = client.delete(f"{run}/versions/same", headers=ADMIN)
    assert deleted.json() == {"run_id": "run-a", "version": 1}
    assert client.get(f"{run}/versions/1", headers=ADMIN).status_code == 404
    assert resolve("same").status_code == 404
    assert [v["version"] for v in client.get(f"{run}/versions", headers=ADMIN).json()] == [2]
    three = client.post(f"{run}/versions", json=commit_body(entry("model/a", a)), headers=ADMIN)
    assert (three.json()["version"], three.json()["parent"]) == (3, 2)
    runs = client.get("/v1/runs", headers=ADMIN).json()
    assert [(r["run_id"], r["versions"], r["latest_version"]) for r in runs] == [("run-a", 2, 3)]
    # Commit with tags.
    four = client.post(f"{run}/versions", json=commit_body(entry("model/a", a), tags=["final"]), headers=ADMIN)
    assert four.json()["tags"] == ["final"]
    assert resolve("final").json()["version"] == 4


def test_missing_and_locate(client: TestClient) -> None:
    absent = tensor(99).digest
    before = client.post("/v1/tensors/missing", json={"digests": [*SMALL.digests, absent]}, headers=ADMIN)
    assert before.json() == {"missing": [*SMALL.digests, absent]}
    upload(client, SMALL)
    after = client.post("/v1/tensors/missing", json={"digests": [absent, *SMALL.digests, absent]}, headers=ADMIN)
    assert after.json() == {"missing": [absent]}
    located = client.post("/v1/tensors/locate", json={"digests": SMALL.digests}, headers=ADMIN).json()
    assert set(located) == set(SMALL.digests)
    first = located[SMALL.digests[0]]
    assert (first["shard_id"], first["offset"], first["nbytes"]) == (SMALL.shard_id, SMALL.header_length, 64)
    assert (first["dtype"], first["shape"]) == ("F32", [4, 4])
    missing = client.post("/v1/tensors/locate", json={"digests": [absent]}, headers=ADMIN)
    assert missing.status_code == 404


# -- OpenAPI, metrics, health -----------------------------------------------------------------


def test_openapi_lists_every_route(app: FastAPI, client: TestClient) -> None:
    assert client.get("/openapi.json").status_code == 401  # a token, as every API route
    spec = client.get("/openapi.json", headers=bearer("read")).json()
    assert spec["info"]["version"] == __version__
    listed = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    routes = {
        (method, str(context.path))
        for context in iter_route_contexts(app.routes)
        if isinstance(context.original_route, APIRoute) and context.original_route.include_in_schema
        for method in context.methods or ()
    }
    assert len(routes) >= 14
    assert listed == routes
    upload_body = spec["paths"]["/v1/shards/{shard_id}"]["put"]["requestBody"]["content"]
    assert "application/octet-stream" in upload_body


def _metrics(client: httpx.Client | TestClient) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
        else:
            assert re.match(r"^# (HELP|TYPE) ckptstore_\w+ ", line), line
    return samples


def test_metrics_count_requests_and_shard_bytes(http: httpx.Client) -> None:
    upload(http, BIG)
    http.put(f"/v1/shards/{BIG.shard_id}", content=BIG.data)  # 200: already stored, bytes still received
    whole = http.get(f"/v1/shards/{BIG.shard_id}").content
    part = http.get(f"/v1/shards/{BIG.shard_id}", headers={"Range": "bytes=10-109"}).content
    http.get("/v1/runs/nope/versions")
    http.get("/v1/not-a-route")
    samples = _metrics(http)
    route = 'route="/v1/shards/{shard_id}"'
    assert samples[f'ckptstore_requests_total{{method="PUT",{route},status="201"}}'] == 1
    assert samples[f'ckptstore_requests_total{{method="PUT",{route},status="200"}}'] == 1
    assert samples[f'ckptstore_requests_total{{method="GET",{route},status="200"}}'] == 1
    assert samples[f'ckptstore_requests_total{{method="GET",{route},status="206"}}'] == 1
    assert samples['ckptstore_requests_total{method="GET",route="/v1/runs/{run_id}/versions",status="404"}'] == 1
    assert samples['ckptstore_requests_total{method="GET",route="unmatched",status="404"}'] == 1
    assert samples['ckptstore_shard_bytes_total{direction="in"}'] == 2 * len(BIG.data)
    assert samples['ckptstore_shard_bytes_total{direction="out"}'] == len(whole) + len(part) == len(BIG.data) + 100
    # The scrape itself is counted by the next one.
    assert _metrics(http)['ckptstore_requests_total{method="GET",route="/metrics",status="200"}'] == 1


def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "version": __version__}


def broken_store(tmp_path: Path) -> Store:
    """A store whose metadata database cannot be opened: every query fails in the database layer."""
    return Store(
        Database(f"sqlite:///{tmp_path / 'no' / 'such' / 'folder.db'}"), LocalBlobStore(tmp_path / "b"), tmp_path / "s"
    )


def full_store(tmp_path: Path) -> Store:
    """A store that must keep more disk in reserve (1 TiB) than its disk has: it takes no shard."""
    home = tmp_path / "full"
    database = Database.sqlite_file(home / "metadata.db")
    return Store(database, LocalBlobStore(home / "blobs"), home / "staging", reserve=SpaceReserve(home, 1 << 40))


def test_healthz_is_503_when_the_database_fails(tmp_path: Path) -> None:
    store = broken_store(tmp_path)
    with TestClient(
        create_app(store, Settings(home=tmp_path / "h")), raise_server_exceptions=False, base_url="http://127.0.0.1"
    ) as client:
        response = client.get("/healthz")
    store.close()
    assert response.status_code == 503
    assert response.headers["x-error-code"] == "storage"
    assert response.json()["message"] == "GET /healthz: " + STORAGE_MESSAGE  # the driver's text is in the log only


# -- the X-Error-Code contract ----------------------------------------------------------------

#: Error classes only the client raises, never sent by the server.
CLIENT_ONLY = {errors.StateMismatchError, errors.StateEncodingError}
#: Raised by no code path today; a subclass keeps its own code.
UNRAISED = {errors.ConflictError}


def _stalled_upload(store: Store, settings: Settings, headers: dict[str, str]) -> httpx.Response:
    """The answer to a large shard upload whose body stops coming (the server's read timeout)."""
    quick = settings.model_copy(update={"body_timeout": 0.5, "min_body_rate": 1000})
    shard_head = header_bytes([("a" * 64, "U8", (MIN_BODY_BYTES,))])
    length = len(shard_head) + MIN_BODY_BYTES
    request = f"PUT /v1/shards/{shard_id(shard_head)} HTTP/1.1\r\nHost: t\r\nContent-Length: {length}\r\n"
    request += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    with (
        running_server(create_app(store, quick), quick) as url,
        socket.create_connection(tuple(url.removeprefix("http://").split(":")), timeout=30) as sock,
    ):
        sock.sendall(request.encode() + shard_head + bytes(1000))  # then nothing more
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    fields = [tuple(part.strip() for part in line.split(":", 1)) for line in lines[1:]]
    return httpx.Response(int(lines[0].split()[1]), headers=fields, content=body)


def _error_responses(tmp_path: Path, serve: Callable[[FastAPI], Served]) -> dict[type[CheckpointError], httpx.Response]:
    """One response per error class the server sends, each from a request that earns it.

    Real uvicorn servers and httpx: the responses are exactly what the client's transport sees.
    """
    settings = Settings(home=tmp_path / "home", tokens=f"read:{'r' * 20},write:{'w' * 20}", max_json_bytes=1 << 16)
    store = Store.open_home(settings.home_path)
    broken, full = broken_store(tmp_path), full_store(tmp_path)
    read, write = {"Authorization": "Bearer " + "r" * 20}, {"Authorization": "Bearer " + "w" * 20}
    found: dict[type[CheckpointError], httpx.Response] = {}
    try:
        with serve(create_app(store, settings)).client() as http:
            upload_to = f"/v1/shards/{SMALL.shard_id}"
            found[errors.InvalidShardError] = http.put(upload_to, content=b"PK\x03\x04 not a shard", headers=write)
            found[errors.IntegrityError] = http.put(upload_to, content=SMALL.data[:-1] + b"\x00", headers=write)
            assert http.put(upload_to, content=SMALL.data, headers=write).status_code == 201
            found[errors.InvalidInputError] = http.get(upload_to, headers={**read, "Range": "bytes=9-3"})
            past_the_end = {**read, "Range": f"bytes={len(SMALL.data)}-"}
            found[errors.RangeNotSatisfiableError] = http.get(upload_to, headers=past_the_end)
            form = {**write, "Content-Type": "application/x-www-form-urlencoded"}
            found[errors.UnsupportedMediaTypeError] = http.post("/v1/tensors/missing", content=b"{}", headers=form)
            found[errors.InvalidNameError] = http.get("/v1/runs/-bad/versions", headers=read)
            found[errors.NotFoundError] = http.get("/v1/runs/nope/versions", headers=read)
            wrong = commit_body(entry("model/w", SMALL.tensors[0], shape=[16]))
            found[errors.InvalidManifestError] = http.post("/v1/runs/r/versions", json=wrong, headers=write)
            lacking = commit_body(entry("model/w", tensor(50)))
            found[errors.MissingTensorsError] = http.post("/v1/runs/r/versions", json=lacking, headers=write)
            big = {"digests": ["0" * 64] * 2000}
            found[errors.PayloadTooLargeError] = http.post("/v1/tensors/missing", json=big, headers=write)
            found[errors.AuthenticationError] = http.get("/v1/runs")
            found[errors.PermissionDeniedError] = http.post("/v1/tensors/missing", json={"digests": []}, headers=read)
            direct = f"/v1/shards/{SMALL.shard_id}/uploads"  # a server on a local folder takes none
            found[errors.DirectUploadsUnavailableError] = http.post(direct, json={"size": 8}, headers=write)
        # Streamed answers (not sendfile's, which hold no memory) wait for room in the budget.
        busy = create_app(store, settings.model_copy(update={"write_timeout": 0.1, "sendfile": False}))
        budget = busy.state.streamer.budget
        asyncio.run(budget.take(budget.total))  # no room for answers: a download waits 0.1 s, then is refused
        with serve(busy).client() as http:
            found[errors.ServerBusyError] = http.get(upload_to, headers=read)
            assert found[errors.ServerBusyError].headers["retry-after"] == "1"
        with serve(create_app(broken, settings)).client() as http:
            found[errors.StorageError] = http.get("/v1/runs", headers=read)
        with serve(create_app(full, settings)).client() as http:
            found[errors.StorageFullError] = http.put(upload_to, content=SMALL.data, headers=write)
        found[errors.RequestTimeoutError] = _stalled_upload(store, settings, write)
    finally:
        store.close()
        broken.close()
        full.close()
    return found


def test_every_error_class_survives_the_round_trip(tmp_path: Path, serve: Callable[[FastAPI], Served]) -> None:
    responses = _error_responses(tmp_path, serve)
    for cls, response in responses.items():
        assert response.status_code == cls.http_status, (cls.__name__, response.status_code, response.text)
        assert response.headers["x-error-code"] == cls.code == response.json()["code"]
        with pytest.raises(CheckpointError) as raised:
            raise_for_error(response)
        assert type(raised.value) is cls, (cls.__name__, type(raised.value).__name__)
        if issubclass(cls, errors.AuthenticationError):  # the client adds where its token is set
            server_message = response.json()["message"].rstrip(". ")
            assert raised.value.message.startswith(server_message + ": set CKPTSTORE_TOKEN")
        else:
            assert raised.value.message == response.json()["message"]
        if cls is errors.MissingTensorsError:
            assert raised.value.digests == [tensor(50).digest]  # type: ignore[attr-defined]
    # Every class the server can send is exercised; a new one fails here until it is added above.
    sent_by_server = set(all_error_classes()) - CLIENT_ONLY - UNRAISED - {CheckpointError}
    assert set(responses) == sent_by_server


def test_framework_errors_map_to_the_nearest_class(http: httpx.Client) -> None:
    not_a_route = http.get("/v1/nothing-here")
    with pytest.raises(errors.NotFoundError):
        raise_for_error(not_a_route)
    validation = http.post("/v1/tensors/missing", json={"digests": "x"})
    assert validation.status_code == 422
    with pytest.raises(errors.InvalidInputError):
        raise_for_error(validation)
    bad_json = http.post("/v1/tensors/missing", content=b"{", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400
    with pytest.raises(errors.InvalidInputError):
        raise_for_error(bad_json)
    wrong_method = http.patch("/v1/runs")
    assert wrong_method.status_code == 405
    with pytest.raises(CheckpointError):
        raise_for_error(wrong_method)


def all_error_classes() -> list[type[CheckpointError]]:
    found, stack = [], [CheckpointError]
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


def test_error_codes_are_unique_and_map_back() -> None:
    classes = all_error_classes()
    codes = [cls.code for cls in classes]
    duplicated = {code for code in codes if codes.count(code) > 1}
    assert not duplicated, f"error codes used by more than one class: {duplicated}"
    assert len(classes) >= 15
    for cls in classes:
        assert error_class_for_code(cls.code) is cls
        assert re.fullmatch(r"[a-z_]+", cls.code)
    assert error_class_for_code("no_such_code") is CheckpointError
