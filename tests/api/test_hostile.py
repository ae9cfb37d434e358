"""Hostile input over real HTTP: corrupt and cut uploads, traversal in names, malformed JSON.

Uploads go through a real uvicorn server (httpx, or a raw socket where the request itself must
be malformed). Every answer must be a 4xx with a JSON error body, never a 5xx; nothing may be
stored and nothing may be left in staging.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.store import Store
from tests.api.kit import (
    Served,
    Shard,
    bearer,
    build_shard,
    commit_body,
    entry,
    files_under,
    is_json_error,
    raw_request,
    staged,
    status_of,
    stored_blobs,
    tensor,
)

MAX_SHARD = 1 << 20
MAX_JSON = 1 << 20  # room for 100,000-deep nesting (200 KB), which must reach the parser
WRITE = bearer("write")
ADMIN = bearer("admin")
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"max_shard_bytes": MAX_SHARD, "max_json_bytes": MAX_JSON}


@pytest.fixture
def http(server: Served) -> Iterator[httpx.Client]:
    with server.client(headers=ADMIN) as client:
        yield client


def assert_nothing_stored(http: httpx.Client, home: Path, *shards: Shard) -> None:
    """No blob, no staged file, and the store still lacks every tensor of ``shards``."""
    assert stored_blobs(home) == []
    assert staged(home) == []
    digests = [d for s in shards for d in s.digests]
    assert http.post("/v1/tensors/missing", json={"digests": digests}).json() == {"missing": digests}


def assert_error(response: httpx.Response, status: int | tuple[int, ...], code: str | None = None) -> None:
    allowed = (status,) if isinstance(status, int) else status
    assert response.status_code in allowed, (response.status_code, response.text[:300])
    assert is_json_error(response), response.text[:300]
    if code is not None:
        assert response.json()["code"] == code


def flip(data: bytes, position: int, bit: int = 0) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 1 << bit
    return bytes(changed)


SHARD = build_shard(tensor(1, "F32", (16, 16)), tensor(2, "I64", (8,)), tensor(3, "BF16", (3, 5)))
OTHER = build_shard(tensor(4))

# -- shard uploads ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "position",
    [SHARD.header_length, SHARD.header_length + 500, len(SHARD.data) - 1],
    ids=["first-data-byte", "middle", "last-byte"],
)
def test_a_flipped_data_bit_is_an_integrity_error_and_nothing_is_stored(
    http: httpx.Client, home: Path, position: int
) -> None:
    response = http.put(f"/v1/shards/{SHARD.shard_id}", content=flip(SHARD.data, position, bit=3))
    assert_error(response, 400, "integrity")
    assert_nothing_stored(http, home, SHARD)


def test_a_flipped_header_bit_changes_the_id_and_is_refused(http: httpx.Client, home: Path) -> None:
    # A flipped bit inside a digest name keeps the JSON valid but no longer names the bytes.
    position = SHARD.data.index(SHARD.digests[0].encode()) + 10
    response = http.put(f"/v1/shards/{SHARD.shard_id}", content=flip(SHARD.data, position, bit=0))
    assert_error(response, 400)
    assert response.json()["code"] in ("integrity", "invalid_shard")
    assert_nothing_stored(http, home, SHARD)


def test_a_valid_shard_under_another_id_is_refused_and_not_stored(http: httpx.Client, home: Path) -> None:
    response = http.put(f"/v1/shards/{OTHER.shard_id}", content=SHARD.data)
    assert_error(response, 400, "integrity")
    assert SHARD.shard_id in response.json()["message"]
    assert_nothing_stored(http, home, SHARD, OTHER)


def test_a_body_cut_off_mid_upload_stores_nothing(server: Served, http: httpx.Client, home: Path) -> None:
    path = f"/v1/shards/{SHARD.shard_id}"
    head = (
        f"PUT {path} HTTP/1.1\r\nHost: test\r\nAuthorization: {WRITE['Authorization']}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(SHARD.data) + 1000}\r\n\r\n"
    ).encode()
    raw_request(server.url, head + SHARD.data, close_after_send=True)
    server.finished.wait("PUT", path)
    assert_nothing_stored(http, home, SHARD)
    # The same shard sent whole afterwards is stored: the cut upload left nothing in the way.
    assert http.put(path, content=SHARD.data).status_code == 201


@pytest.mark.parametrize("change", [-1, +1], ids=["one-byte-short", "one-byte-long"])
def test_one_byte_short_or_long_is_refused(http: httpx.Client, home: Path, change: int) -> None:
    body = SHARD.data[:-1] if change < 0 else SHARD.data + b"\0"
    response = http.put(f"/v1/shards/{SHARD.shard_id}", content=body)
    assert_error(response, 400, "invalid_shard")
    assert_nothing_stored(http, home, SHARD)


def test_an_empty_body_is_refused(http: httpx.Client, home: Path) -> None:
    response = http.put(f"/v1/shards/{SHARD.shard_id}", content=b"")
    assert_error(response, 400, "invalid_input")
    assert_nothing_stored(http, home, SHARD)


@pytest.mark.parametrize(
    "length",
    ["-1", "-100", "abc", "1e3", "+5", "0x10", " ", "12 34", "99999999999999999999999999", f"{len(SHARD.data)}, 5"],
)
def test_a_bad_content_length_is_refused(server: Served, http: httpx.Client, home: Path, length: str) -> None:
    head = (
        f"PUT /v1/shards/{SHARD.shard_id} HTTP/1.1\r\nHost: test\r\nAuthorization: {WRITE['Authorization']}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()
    answer = raw_request(server.url, head + SHARD.data)
    assert 400 <= status_of(answer) < 500, answer[:300]
    assert_nothing_stored(http, home, SHARD)


def test_two_different_content_lengths_are_refused(server: Served, http: httpx.Client, home: Path) -> None:
    head = (
        f"PUT /v1/shards/{SHARD.shard_id} HTTP/1.1\r\nHost: test\r\nAuthorization: {WRITE['Authorization']}\r\n"
        f"Content-Length: {len(SHARD.data)}\r\nContent-Length: 10\r\nConnection: close\r\n\r\n"
    ).encode()
    answer = raw_request(server.url, head + SHARD.data)
    assert 400 <= status_of(answer) < 500, answer[:300]
    assert_nothing_stored(http, home, SHARD)


def test_an_upload_over_the_limit_is_413(http: httpx.Client, home: Path) -> None:
    big = build_shard(tensor(9, "U8", (MAX_SHARD,)))
    declared = http.put(f"/v1/shards/{big.shard_id}", content=big.data)
    assert_error(declared, 413, "payload_too_large")

    def chunks() -> Any:  # no Content-Length: the server counts as the bytes arrive
        for start in range(0, len(big.data), 256 << 10):
            yield big.data[start : start + (256 << 10)]

    streamed = http.put(f"/v1/shards/{big.shard_id}", content=chunks())
    assert_error(streamed, 413, "payload_too_large")
    assert_nothing_stored(http, home, big)


def test_a_chunked_upload_without_length_is_accepted(http: httpx.Client) -> None:
    response = http.put(f"/v1/shards/{SHARD.shard_id}", content=iter([SHARD.data[:100], SHARD.data[100:]]))
    assert response.status_code == 201
    assert response.json()["shard_id"] == SHARD.shard_id


NOT_SAFETENSORS = {
    "torch-save-zip": b"PK\x03\x04\x14\x00\x00\x00\x00\x00" + b"archive/data.pkl" + b"\x00" * 64,
    "raw-pickle": b"\x80\x04\x95\x1f\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x02id\x85R.",
    "html": b"<!DOCTYPE html><html><body><script>alert(1)</script></body></html>",
    "svg": b'<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)"/>',
    "npy": b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }" + b" " * 40 + b"\n",
    "7z": b"7z\xbc\xaf\x27\x1c\x00\x04" + b"\x00" * 32,
    "gzip": b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + b"\x00" * 32,
    "json-only": b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
    "tiny": b"\x01",
    "length-max": b"\xff" * 8 + b"{}",
}


@pytest.mark.parametrize("body", list(NOT_SAFETENSORS.values()), ids=list(NOT_SAFETENSORS))
def test_files_that_are_not_safetensors_are_invalid_shards(http: httpx.Client, home: Path, body: bytes) -> None:
    response = http.put(f"/v1/shards/{SHARD.shard_id}", content=body)
    assert_error(response, 400, "invalid_shard")
    assert_nothing_stored(http, home, SHARD)


def test_a_polyglot_with_data_after_the_tensors_is_refused(http: httpx.Client, home: Path) -> None:
    zip_tail = NOT_SAFETENSORS["torch-save-zip"]
    response = http.put(f"/v1/shards/{SHARD.shard_id}", content=SHARD.data + zip_tail)
    assert_error(response, 400, "invalid_shard")
    assert "trailing" in response.json()["message"]
    assert_nothing_stored(http, home, SHARD)


def test_the_same_shard_uploaded_eight_times_at_once_is_stored_once(
    server: Served, http: httpx.Client, home: Path
) -> None:
    barrier = threading.Barrier(8, timeout=30)
    statuses: list[int] = []
    receipts: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def upload() -> None:
        try:
            with server.client(headers=WRITE) as own:
                barrier.wait()
                response = own.put(f"/v1/shards/{SHARD.shard_id}", content=SHARD.data)
            statuses.append(response.status_code)
            receipts.append(response.json())
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=upload) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert sorted(statuses) == [200] * 7 + [201]
    assert sum(r["created"] for r in receipts) == 1
    assert {r["shard_id"] for r in receipts} == {SHARD.shard_id}
    assert [p.name for p in stored_blobs(home)] == [SHARD.shard_id]
    assert staged(home) == []
    assert http.post("/v1/tensors/missing", json={"digests": SHARD.digests}).json() == {"missing": []}
    located = http.post("/v1/tensors/locate", json={"digests": SHARD.digests}).json()
    assert {loc["shard_id"] for loc in located.values()} == {SHARD.shard_id}


# -- identifiers in URLs ----------------------------------------------------------------------

TRAVERSAL = [
    "..",
    "../",
    "../../etc/passwd",
    "..%2f",
    "..%2F..%2Fetc%2Fpasswd",
    "%2e%2e%2f",
    "%2e%2e",
    "%252e%252e%252f",
    "..\\..\\",
    "..%5c..%5c",
    "/etc/passwd",
    "%2Fetc%2Fpasswd",
    "C:\\",
    "C:%5CWindows",
    "\\\\server\\share",
    "file:///etc/passwd",
    "//proc/self/root",
    "http:///#/../../etc/",
    "?x=../",
    "%c0%ae%c0%ae%2f",
    "%00",
    "run%00",
    "a%0d%0aSet-Cookie:%20x=1",
    "%0d%0a",
    "%EF%BC%8E%EF%BC%8E%EF%BC%8F",  # fullwidth ．．／
    "．．／",
    "run\u202e",
    "a" * 300,
    "a" * 5000,
    "b" * 129,
    "-run",
    ".hidden",
    ".%2f",
    "x%0d%0aSet-Cookie:%20y=1%2f",
]


def _forms(name: str) -> list[str]:
    """The name as spelled (already-encoded escapes kept) and fully percent-encoded.

    Names with '?' or '#' are URL syntax when spelled raw (a query or fragment, not a name),
    so they are only sent encoded.
    """
    encoded = quote(name, safe="")
    raw = quote(name, safe="/%\\:?#=")
    return [encoded] if ("?" in name or "#" in name) else list(dict.fromkeys([raw, encoded]))


def _requests(x: str) -> list[tuple[str, str, bytes | None]]:
    tag = json.dumps({"version": 1}).encode()
    commit = json.dumps(commit_body(entry("model/w", SHARD.tensors[0]))).encode()
    return [
        ("GET", f"/v1/runs/{x}/versions", None),
        ("GET", f"/v1/runs/{x}/versions/1", None),
        ("GET", f"/v1/runs/run-a/versions/{x}", None),
        ("GET", f"/v1/runs/run-a/refs/{x}", None),
        ("POST", f"/v1/runs/{x}/versions", commit),
        ("PUT", f"/v1/runs/{x}/tags/best", tag),
        ("PUT", f"/v1/runs/run-a/tags/{x}", tag),
        ("DELETE", f"/v1/runs/run-a/tags/{x}", None),
        ("DELETE", f"/v1/runs/run-a/versions/{x}", None),
    ]


def test_traversal_and_odd_names_in_urls_are_4xx_and_touch_nothing(
    server: Served, store: Store, tmp_path: Path, home: Path
) -> None:
    path = store.staging_path()
    path.write_bytes(SHARD.data)
    store.ingest_file(path)
    with httpx.Client(base_url=server.url, headers=ADMIN) as http:
        assert http.post("/v1/runs/run-a/versions", json=commit_body(entry("model/w", SHARD.tensors[0]))).is_success
        before = http.get("/v1/runs/run-a/versions").json()
    outside_before = files_under(tmp_path) - {p for p in files_under(tmp_path) if p.startswith("home")}
    home_before = files_under(home)
    parts = urlsplit(server.url)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=30)
    wrong = []
    try:
        for name in TRAVERSAL:
            for form in _forms(name):
                for method, target, body in _requests(form):
                    headers = {**ADMIN, **(JSON if body else {})}
                    connection.request(method, target, body=body, headers=headers)
                    response = connection.getresponse()
                    text = response.read()
                    ok = response.status in (400, 404, 405, 422)
                    if ok:
                        try:
                            payload = json.loads(text)
                            ok = response.getheader("x-error-code") == payload["code"] and "message" in payload
                        except (ValueError, KeyError):
                            ok = False
                    if not ok:
                        wrong.append(f"{method} {target[:90]} -> {response.status} {text[:100]!r}")
    finally:
        connection.close()
    assert not wrong, "\n".join(wrong)
    outside_after = files_under(tmp_path) - {p for p in files_under(tmp_path) if p.startswith("home")}
    assert outside_after == outside_before
    # Inside home only SQLite's own journal files may come and go.
    changed = files_under(home) ^ home_before
    assert all(p.startswith("metadata.db") for p in changed), changed
    with httpx.Client(base_url=server.url, headers=ADMIN) as http:
        assert [r["run_id"] for r in http.get("/v1/runs").json()] == ["run-a"]
        assert http.get("/v1/runs/run-a/versions").json() == before


BAD_DIGESTS = [
    SHARD.shard_id.upper(),
    SHARD.shard_id[:63],
    SHARD.shard_id + "0",
    "sha256:" + SHARD.shard_id,
    "sha256%3A" + SHARD.shard_id,
    "g" * 64,
    " " * 64,
    "%20" * 64,
    "%00" + SHARD.shard_id[1:],
    SHARD.shard_id[:62] + "%0d%0a",
    quote("０" * 64),  # fullwidth digits look like hex
    quote("\u0661" * 64),  # Arabic-Indic digit one
    "..%2f" + SHARD.shard_id[5:],
    SHARD.shard_id + "%2f..",
]


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_malformed_shard_ids_are_4xx(server: Served, home: Path, method: str) -> None:
    parts = urlsplit(server.url)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        for bad in BAD_DIGESTS:
            connection.request(method, f"/v1/shards/{bad.replace(' ', '%20')}", body=SHARD.data, headers=WRITE)
            response = connection.getresponse()
            text = response.read()
            assert response.status in (400, 404, 405, 422), (bad, response.status, text[:200])
            assert json.loads(text)["code"] == response.getheader("x-error-code")
    finally:
        connection.close()
    assert stored_blobs(home) == []
    assert staged(home) == []


# -- JSON bodies ------------------------------------------------------------------------------


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


D = SHARD.digests[0]
GOOD_ENTRY = entry("model/w", SHARD.tensors[0])
BAD_MISSING_BODIES: dict[str, bytes] = {
    "unknown-field": json.dumps({"digests": [D], "extra": 1}).encode(),
    "digests-string": json.dumps({"digests": D}).encode(),
    "int-for-digest": b'{"digests": [1]}',
    "float-for-digest": b'{"digests": [1.0]}',
    "bool-for-digest": b'{"digests": [true]}',
    "nan": b'{"digests": [NaN]}',
    "infinity": b'{"digests": [Infinity]}',
    "minus-infinity": b'{"digests": [-Infinity]}',
    "nan-string": b'{"digests": ["NaN"]}',
    "1e400": b'{"digests": [1e400]}',
    "int-over-int64": b'{"digests": [9223372036854775808]}',
    "int-5000-digits": b'{"digests": [' + b"9" * 5000 + b"]}",
    "duplicate-keys": b'{"digests": ["' + D.encode() + b'"], "digests": []}',
    "deep": b'{"digests": ' + _deep(100_000).encode() + b"}",
    "deep-objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "uppercase-digest": json.dumps({"digests": [D.upper()]}).encode(),
    "top-level-list": json.dumps([D]).encode(),
    "null": b"null",
    "empty": b"",
    "trailing-garbage": json.dumps({"digests": [D]}).encode() + b" x",
    "utf16": json.dumps({"digests": [D]}).encode("utf-16"),
    "utf16-le-no-bom": json.dumps({"digests": [D]}).encode("utf-16-le"),
    "bom": b"\xef\xbb\xbf" + json.dumps({"digests": [D]}).encode(),
    "latin1": b'{"digests": ["\xe9"]}',
    "lone-surrogate": b'{"digests": ["\\ud800"]}',
    "truncated": b'{"digests": ["' + D.encode(),
}


def _commit(**manifest_changes: Any) -> bytes:
    body = commit_body(GOOD_ENTRY)
    body["manifest"].update(manifest_changes)
    return json.dumps(body).encode()


def _commit_raw(fragment: bytes) -> bytes:
    """A good commit body with raw JSON text (which json.dumps would refuse) put into its manifest."""
    return _commit().replace(b'"tensors"', fragment + b', "tensors"')


def _commit_entry(**entry_changes: Any) -> bytes:
    return json.dumps(commit_body({**GOOD_ENTRY, **entry_changes})).encode()


BAD_COMMIT_BODIES: dict[str, bytes] = {
    "unknown-top-field": json.dumps({**commit_body(GOOD_ENTRY), "admin": True}).encode(),
    "unknown-manifest-field": _commit(owner="me"),
    "unknown-entry-field": _commit_entry(path="../../etc/passwd"),
    "step-string": _commit(step="1"),
    "step-float": _commit(step=1.0),
    "step-bool": _commit(step=True),
    "step-negative": _commit(step=-1),
    "step-over-int64": _commit(step=2**63),
    "step-huge": _commit(step=10**30),
    "step-nan": _commit_raw(b'"step": NaN'),
    "step-infinity": _commit_raw(b'"step": Infinity'),
    "step-nan-string": _commit(step="NaN"),
    "step-1e400": _commit_raw(b'"step": 1e400'),
    "metric-nan": _commit_raw(b'"metrics": {"loss": NaN}'),
    "metric-string": _commit(metrics={"loss": "nan"}),  # "NaN" is a metric; "nan" is no spelling of one
    "shape-strings": _commit_entry(shape=["16", "16"]),
    "shape-floats": _commit_entry(shape=[16.0, 16.0]),
    "shape-bools": _commit_entry(shape=[True, 16]),
    "shape-negative": _commit_entry(shape=[-16, -16]),
    "shape-over-int64": _commit_entry(shape=[2**63, 1]),
    "shape-overflow-product": _commit_entry(shape=[4194305, 4194305, 211106198978564]),
    "dtype-lowercase": _commit_entry(dtype="f32"),
    "dtype-unknown": _commit_entry(dtype="F128"),
    "device-negative": _commit_entry(device_type="cuda:-1"),
    "device-injection": _commit_entry(device_type="cuda:0; rm -rf /"),
    "device-empty": _commit_entry(device_type=""),
    "device-10kb": _commit_entry(device_type="c" * 10_000),
    "key-traversal": _commit_entry(key="../../etc/passwd"),
    "key-newline": _commit_entry(key="model/a\nb"),
    "placement-param-without-param": _commit_entry(placement="param"),
    "digest-and-chunks": _commit_entry(chunks=[{"offsets": [0, 0], "shape": [16, 16], "digest": D}]),
    "no-digest": json.dumps(commit_body({k: v for k, v in GOOD_ENTRY.items() if k != "digest"})).encode(),
    "same-key-twice": json.dumps(commit_body(GOOD_ENTRY, GOOD_ENTRY)).encode(),
    "tags-not-list": json.dumps({**commit_body(GOOD_ENTRY), "tags": "best"}).encode(),
    "tag-traversal": json.dumps(commit_body(GOOD_ENTRY, tags=["../x"])).encode(),
    "tag-latest": json.dumps(commit_body(GOOD_ENTRY, tags=["latest"])).encode(),
    "state-deep": _commit_raw(b'"state": {"extra": ' + _deep(100_000).encode() + b"}"),
    "state-moderately-deep": _commit_raw(b'"state": {"extra": ' + _deep(100).encode() + b"}"),
    "state-dangling-tensor": _commit(state={"extra": {"__tensor__": "model/nope"}}),
    "state-unknown-section": _commit(state={"model": {}}),
    "format-wrong": _commit(format="ckptstore.manifest/2"),
    "duplicate-manifest": b'{"manifest": {"tensors": []}, ' + _commit()[1:],
    "duplicate-entry-key": _commit_entry().replace(b'"key": "model/w"', b'"key": "model/w", "key": "model/v"'),
    "manifest-null": b'{"manifest": null}',
    "empty-object": b"{}",
    "utf16": _commit().decode().encode("utf-16"),
    "bom": b"\xef\xbb\xbf" + _commit(),
}


@pytest.fixture
def seeded(store: Store) -> Store:
    path = store.staging_path()
    path.write_bytes(SHARD.data)
    store.ingest_file(path)
    return store


@pytest.mark.parametrize("body", list(BAD_MISSING_BODIES.values()), ids=list(BAD_MISSING_BODIES))
def test_bad_json_to_missing_is_4xx_with_a_json_error(client: TestClient, body: bytes) -> None:
    response = client.post("/v1/tensors/missing", content=body, headers={**WRITE, **JSON})
    assert_error(response, (400, 422))


@pytest.mark.parametrize("body", list(BAD_COMMIT_BODIES.values()), ids=list(BAD_COMMIT_BODIES))
def test_bad_json_to_commit_is_4xx_with_a_json_error(client: TestClient, seeded: Store, body: bytes) -> None:
    response = client.post("/v1/runs/run-a/versions", content=body, headers={**WRITE, **JSON})
    assert_error(response, (400, 422))
    assert seeded.runs() == []


def test_the_bad_commit_bodies_differ_from_a_good_one_only_in_the_flaw(client: TestClient, seeded: Store) -> None:
    """The good body the flaws are made from commits; so each refusal above is the flaw's doing."""
    response = client.post("/v1/runs/run-a/versions", content=_commit(), headers={**WRITE, **JSON})
    assert response.status_code == 201, response.text


@pytest.mark.parametrize("route", ["/v1/tensors/missing", "/v1/runs/run-a/versions"])
def test_a_json_body_over_the_limit_is_413(client: TestClient, server: Served, route: str) -> None:
    body = json.dumps({"digests": [D] * 16_000}).encode()
    assert len(body) > MAX_JSON
    declared = client.post(route, content=body, headers={**WRITE, **JSON})
    assert_error(declared, 413, "payload_too_large")
    with server.client(headers={**WRITE, **JSON}) as http:  # chunked, so the server has to count
        streamed = http.post(route, content=iter([body[:400_000], body[400_000:]]))
    assert_error(streamed, 413, "payload_too_large")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml"])
@pytest.mark.parametrize("route", ["/v1/tensors/missing", "/v1/runs/run-a/versions"])
def test_a_wrong_content_type_is_4xx(client: TestClient, seeded: Store, route: str, content_type: str) -> None:
    body = json.dumps({"digests": [D]}).encode() if "tensors" in route else _commit()
    response = client.post(route, content=body, headers={**WRITE, "Content-Type": content_type})
    assert_error(response, (400, 415, 422))
    assert seeded.runs() == []


# -- commit consistency -----------------------------------------------------------------------


def test_a_commit_of_a_digest_the_server_lacks_is_409_listing_it(client: TestClient, seeded: Store) -> None:
    absent = tensor(77)
    body = commit_body(GOOD_ENTRY, entry("optim/state/0/exp_avg", absent))
    response = client.post("/v1/runs/run-a/versions", json=body, headers=WRITE)
    assert_error(response, 409, "missing_tensors")
    assert response.json()["digests"] == [absent.digest]
    assert seeded.runs() == []


@pytest.mark.parametrize(
    "change",
    [{"shape": [8, 32]}, {"shape": [256]}, {"shape": [16, 16, 1]}, {"dtype": "I32", "dtype_class": "integer"}],
    ids=["reshaped", "flattened", "extra-dim", "dtype"],
)
def test_a_commit_disagreeing_with_the_stored_tensor_is_422(
    client: TestClient, seeded: Store, change: dict[str, Any]
) -> None:
    response = client.post("/v1/runs/run-a/versions", json=commit_body({**GOOD_ENTRY, **change}), headers=WRITE)
    assert_error(response, 422, "invalid_manifest")
    assert seeded.runs() == []


def test_a_commit_with_the_same_key_twice_is_422(client: TestClient, seeded: Store) -> None:
    other = entry("model/w", SHARD.tensors[1])
    response = client.post("/v1/runs/run-a/versions", json=commit_body(GOOD_ENTRY, other), headers=WRITE)
    assert_error(response, 422)
    assert "twice" in response.json()["message"]
    assert seeded.runs() == []


#: Shapes with no element whose strides or size overflow 64 bits (torch cannot make them), and
#: the largest F32 shapes that fit (4 × 2**61 is 2**63).
OVERFLOWING_SHAPES = [[0, 2**62, 2**62], [0, 2**63], [2**62, 2**62, 0], [0, 2**61], [0, 0, 2**61, 1]]
FITTING_SHAPES = [[0, 2**61 - 1], [2**61 - 1, 0, 0]]


def _empty_entry(shape: list[int]) -> dict[str, Any]:
    return {
        "key": "extra/huge",
        "dtype": "F32",
        "shape": shape,
        "dtype_class": "floating",
        "digest": tensor_digest("F32", shape, b""),
        "placement": "host",
        "device_type": "cpu",
    }


@pytest.mark.parametrize("shape", OVERFLOWING_SHAPES, ids=str)
def test_a_commit_of_a_shape_whose_strides_overflow_is_422_naming_it(
    client: TestClient, seeded: Store, shape: list[int]
) -> None:
    response = client.post("/v1/runs/run-a/versions", json=commit_body(GOOD_ENTRY, _empty_entry(shape)), headers=WRITE)
    assert_error(response, 422)  # refused by the request's model, as every malformed manifest is
    message = response.json()["message"]
    assert f"extra/huge: shape {shape}" in message and "overflow 64-bit integers" in message, message
    assert seeded.runs() == []


@pytest.mark.parametrize("shape", FITTING_SHAPES, ids=str)
def test_a_commit_of_an_empty_shape_just_inside_the_bound_is_stored(
    client: TestClient, seeded: Store, shape: list[int]
) -> None:
    response = client.post("/v1/runs/run-a/versions", json=commit_body(GOOD_ENTRY, _empty_entry(shape)), headers=WRITE)
    assert response.status_code == 201, response.text
    assert seeded.manifest("run-a").tensors[1].shape == shape


# -- fuzz -------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from([D, "model/w", "F32", "floating", "target", "cpu", "__tensor__", "latest"]),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)
FIELDS = ["manifest", "tags", "tensors", "state", "step", "metrics", "library", "format", "digest_algorithm"]
ENTRY_FIELDS = list(GOOD_ENTRY) + ["chunks", "param", "trainable"]


@st.composite
def commit_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "mutated-top", "mutated-manifest", "mutated-entry", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "random":
        return json.dumps(draw(json_values)).encode()
    body = commit_body(dict(GOOD_ENTRY))
    target = {
        "mutated-top": body,
        "mutated-manifest": body["manifest"],
        "mutated-entry": body["manifest"]["tensors"][0],
    }[kind]
    field = draw(st.sampled_from(FIELDS + ENTRY_FIELDS) | st.text(max_size=8))
    if draw(st.booleans()):
        target[field] = draw(json_values)
    else:
        target.pop(field, None)
    return json.dumps(body).encode()


@pytest.mark.slow  # 200 fuzzed commit bodies
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=commit_bodies())
def test_fuzzed_commit_bodies_never_get_a_5xx(client: TestClient, seeded: Store, body: bytes) -> None:
    response = client.post("/v1/runs/fuzz/versions", content=body, headers={**WRITE, **JSON})
    assert response.status_code < 500, (body[:300], response.text[:300])
    if response.status_code >= 400:
        assert is_json_error(response)
    else:
        assert response.status_code == 201
