"""Shard downloads speak plain HTTP (RFC 9110), as curl and orchestration scripts expect: suffix
ranges, 416 with ``Content-Range: bytes */N`` past the end, HEAD, and ``If-None-Match`` on the
immutable, content-addressed shards. All against a real uvicorn server over PostgreSQL with the
shard bytes in a real (moto) S3 bucket; HEAD is checked on a raw socket, so nothing between the
test and the server could add or drop a body. Ranges are also drawn by Hypothesis and checked
against Python slicing of the shard's real bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.api import create_app
from ckptstore.service.blobs.s3 import S3BlobStore, make_client
from ckptstore.service.db import Database, schema
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, bearer, build_shard, raw_request, tensor
from tests.servers import running_server

SHARD = build_shard(tensor(31, "F32", (97, 101)), tensor(32, "U8", (4_999,)))  # ~44 KB, odd length
SIZE = len(SHARD.data)
PATH = f"/v1/shards/{SHARD.shard_id}"
ABSENT = f"/v1/shards/{'e' * 64}"
ETAG = f'"{SHARD.shard_id}"'
READ = bearer("read")


@pytest.fixture(scope="module")
def base_url(postgres_databases: Any, s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server on a fresh PostgreSQL database and a fresh S3 bucket, holding SHARD (uploaded over HTTP)."""
    url = postgres_databases.create()
    database = Database(url)
    schema.upgrade(database)
    s3 = make_client(s3_endpoint)
    bucket = f"shard-http-{uuid.uuid4().hex[:16]}"
    s3.create_bucket(Bucket=bucket)
    home = tmp_path_factory.mktemp("shard-http")
    store = Store(database, S3BlobStore(bucket, "shards", client=s3), home / "staging")
    settings = Settings(home=home, database_url=url, blobs=f"s3://{bucket}/shards", tokens=TOKENS)
    try:
        with running_server(create_app(store, settings)) as served:
            put = httpx.put(served + PATH, content=SHARD.data, headers=bearer("write"), timeout=30)
            assert put.status_code == 201, put.text
            keys = [item["Key"] for item in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
            assert any(SHARD.shard_id in key for key in keys), keys  # the bytes served come from S3
            yield served
    finally:
        store.close()
        for item in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=item["Key"])
        s3.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    """A client with a read token (the scope a download needs)."""
    with httpx.Client(base_url=base_url, headers=READ, timeout=30) as client:
        yield client


def raw(base_url: str, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """Send one request on a raw socket; its status, headers (lowercased names) and every byte after them."""
    host = urlsplit(base_url).netloc
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    answer = raw_request(base_url, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    head, _, rest = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return int(status_line.split(" ")[1]), fields, rest


# -- ranges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", [f"bytes={SIZE}-", f"bytes={SIZE}-{SIZE + 10}", f"bytes={SIZE + 1}-",
                                    "bytes=9999999999999999999-", "bytes=-0"])  # fmt: skip
def test_an_unsatisfiable_range_is_416_naming_the_size(http: httpx.Client, header: str) -> None:
    response = http.get(PATH, headers={"Range": header})
    assert response.status_code == 416, response.text
    assert response.headers["content-range"] == f"bytes */{SIZE}"
    assert response.headers["x-error-code"] == response.json()["code"] == "range_not_satisfiable"
    assert str(SIZE) in response.json()["message"]


@pytest.mark.parametrize("suffix", [1, 500, SIZE - 1, SIZE, SIZE + 1, 10**18])
def test_a_suffix_range_is_the_last_bytes(http: httpx.Client, suffix: int) -> None:
    """``curl -r -500``: the last 500 bytes; a suffix longer than the shard is all of it."""
    response = http.get(PATH, headers={"Range": f"bytes=-{suffix}"})
    assert response.status_code == 206, response.text
    start = max(SIZE - suffix, 0)
    assert response.headers["content-range"] == f"bytes {start}-{SIZE - 1}/{SIZE}"
    assert response.headers["content-length"] == str(SIZE - start)
    assert response.content == SHARD.data[-suffix:]


def test_the_range_unit_is_case_insensitive(http: httpx.Client) -> None:
    response = http.get(PATH, headers={"Range": "Bytes=10-19"})
    assert response.status_code == 206 and response.content == SHARD.data[10:20]


# Malformed headers, built so that none can be a valid single range: each answer is a 400.
_n = st.integers(min_value=0, max_value=10**6)
MALFORMED = st.one_of(
    st.builds("bytes={}-{},{}-{}".format, _n, _n, _n, _n),  # several ranges
    st.builds("items={}-{}".format, _n, _n),  # another unit
    st.builds("bytes={}".format, _n),  # no dash
    st.builds("bytes={}-{}-".format, _n, _n),
    st.builds("bytes=--{}".format, _n),
    st.builds("bytes={}-".format, st.integers(min_value=10**19, max_value=10**30)),  # past 19 digits
    st.builds("bytes=-{}".format, st.integers(min_value=10**19, max_value=10**30)),
    st.builds("bytes={}.5-".format, _n),
    st.builds("bytes = {}-{}".format, _n, _n),
    st.builds("bytes={}- {}".format, _n, _n),
    # HTTP header values cannot start or end with whitespace (the client refuses to send them).
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters="0123456789")).filter(
        lambda text: text == text.strip()
    ),
)
RANGES = st.one_of(
    st.tuples(st.just("span"), st.integers(0, SIZE * 2), st.one_of(st.none(), st.integers(0, SIZE * 2))),
    st.tuples(st.just("big"), st.integers(0, 10**19 - 1), st.one_of(st.none(), st.integers(0, 10**19 - 1))),
    st.tuples(st.just("suffix"), st.integers(0, SIZE * 2), st.none()),
    st.tuples(st.just("suffix"), st.integers(0, 10**19 - 1), st.none()),
    st.tuples(st.just("malformed"), MALFORMED, st.none()),
)


def expected(kind: str, first: Any, last: int | None) -> tuple[int, bytes | None, str | None]:
    """What RFC 9110 (with 400 for a malformed header) says to answer: status, body, Content-Range."""
    if kind == "malformed":
        return 400, None, None
    if kind == "suffix":
        if first == 0:
            return 416, None, f"bytes */{SIZE}"
        body = SHARD.data[-first:]
        return 206, body, f"bytes {SIZE - len(body)}-{SIZE - 1}/{SIZE}"
    if last is not None and last < first:
        return 400, None, None
    if first >= SIZE:
        return 416, None, f"bytes */{SIZE}"
    body = SHARD.data[first : None if last is None else last + 1]
    return 206, body, f"bytes {first}-{first + len(body) - 1}/{SIZE}"


def header_of(kind: str, first: Any, last: int | None) -> str:
    """The Range header for a drawn case."""
    if kind == "malformed":
        return str(first)
    if kind == "suffix":
        return f"bytes=-{first}"
    return f"bytes={first}-{'' if last is None else last}"


@pytest.mark.slow  # 150 drawn Range headers against a real server
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=RANGES)
def test_any_range_header_matches_python_slicing(http: httpx.Client, case: tuple[str, Any, int | None]) -> None:
    header = header_of(*case)
    status, body, content_range = expected(*case)
    response = http.get(PATH, headers={"Range": header})
    assert response.status_code == status, (header, response.text[:200])
    assert response.headers.get("content-range") == content_range, header
    if body is not None:
        assert response.content == body
        assert response.headers["content-length"] == str(len(body))
    else:
        assert response.json()["code"] == response.headers["x-error-code"]


# -- HEAD -----------------------------------------------------------------------------------------


def test_head_answers_the_headers_of_a_get_without_a_body(base_url: str, http: httpx.Client) -> None:
    status, fields, rest = raw(base_url, "HEAD", PATH, READ)
    assert status == 200
    assert rest == b""  # the server closed the connection after the headers
    assert fields["content-length"] == str(SIZE)
    assert fields["etag"] == ETAG and fields["accept-ranges"] == "bytes"
    assert "immutable" in fields["cache-control"] and "transfer-encoding" not in fields
    get = http.get(PATH)
    for name in ("content-length", "etag", "accept-ranges", "cache-control", "content-type"):
        assert fields[name] == get.headers[name], name


def test_head_of_a_range_is_206_with_its_content_range(base_url: str) -> None:
    status, fields, rest = raw(base_url, "HEAD", PATH, {**READ, "Range": "bytes=-500"})
    assert (status, rest) == (206, b"")
    assert fields["content-range"] == f"bytes {SIZE - 500}-{SIZE - 1}/{SIZE}" and fields["content-length"] == "500"
    status, fields, rest = raw(base_url, "HEAD", PATH, {**READ, "Range": f"bytes={SIZE}-"})
    assert (status, fields["content-range"], rest) == (416, f"bytes */{SIZE}", b"")


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [({}, 401, "unauthorized"), ({"Authorization": "Bearer not-a-token-at-all"}, 401, "unauthorized")],
)
def test_head_needs_a_read_token_as_get_does(base_url: str, headers: dict[str, str], status: int, code: str) -> None:
    answer, fields, rest = raw(base_url, "HEAD", PATH, headers)
    assert (answer, fields["x-error-code"], rest) == (status, code, b"")
    assert raw(base_url, "GET", PATH, headers)[0] == status
    for scope in ("read", "write", "admin"):
        assert raw(base_url, "HEAD", PATH, bearer(scope))[0] == 200, scope


def test_head_of_an_absent_shard_is_404(base_url: str) -> None:
    status, fields, rest = raw(base_url, "HEAD", ABSENT, READ)
    assert (status, fields["x-error-code"], rest) == (404, "not_found", b"")


# -- If-None-Match and caching --------------------------------------------------------------------


@pytest.mark.parametrize("tag", [ETAG, f"W/{ETAG}", "*", f'"{"0" * 64}", {ETAG}', f'{ETAG},"other"'])
def test_if_none_match_with_the_shards_etag_is_304(base_url: str, http: httpx.Client, tag: str) -> None:
    response = http.get(PATH, headers={"If-None-Match": tag})
    assert response.status_code == 304 and response.content == b""
    assert response.headers["etag"] == ETAG and "immutable" in response.headers["cache-control"]
    ranged = http.get(PATH, headers={"If-None-Match": tag, "Range": "bytes=0-9"})
    assert ranged.status_code == 304  # If-None-Match is weighed before Range
    status, fields, rest = raw(base_url, "HEAD", PATH, {**READ, "If-None-Match": tag})
    assert (status, fields["etag"], rest) == (304, ETAG, b"")


@pytest.mark.parametrize("tag", [f'"{"0" * 64}"', SHARD.shard_id, f'"{SHARD.shard_id[:-1]}"', '""', "W/"])
def test_if_none_match_with_another_tag_sends_the_bytes(http: httpx.Client, tag: str) -> None:
    response = http.get(PATH, headers={"If-None-Match": tag})
    assert response.status_code == 200 and response.content == SHARD.data


def test_if_none_match_on_an_absent_shard_is_still_404(http: httpx.Client) -> None:
    response = http.get(ABSENT, headers={"If-None-Match": "*"})
    assert response.status_code == 404 and response.json()["code"] == "not_found"


def test_the_bytes_may_be_cached_for_good_by_the_client_only(http: httpx.Client) -> None:
    for headers in ({}, {"Range": "bytes=5-9"}):
        response = http.get(PATH, headers=headers)
        directives = {d.strip() for d in response.headers["cache-control"].split(",")}
        assert {"immutable", "private"} <= directives, directives
        assert response.headers["etag"] == ETAG
    assert "cache-control" not in http.get(PATH, headers={"Range": f"bytes={SIZE}-"}).headers
    assert "cache-control" not in http.get(ABSENT).headers
