"""``POST /v1/shards/ranges`` on a real uvicorn server: many shards' byte ranges in one answer,
and a clear 4xx for every bad batch, decided before any byte is sent."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptstore.service.api import create_app
from ckptstore.service.api.http.range_batch import MAX_BATCH_BYTES, MAX_RANGES, ByteRange, stream_batch
from ckptstore.service.blobs import MemoryBlobStore
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, Shard, bearer, build_shard, is_json_error, tensor
from tests.servers import running_server

SHARDS = [build_shard(tensor(20 + i, "F32", (8, 8)), tensor(40 + i, "I64", (5,))) for i in range(3)]
ROUTE = "/v1/shards/ranges"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server holding SHARDS, with read, write and admin tokens."""
    folder: Path = tmp_path_factory.mktemp("ranges")
    store = Store.open_home(folder)
    try:
        with running_server(create_app(store, Settings(home=folder, tokens=TOKENS))) as url:
            with httpx.Client(base_url=url, headers=bearer("write")) as http:
                for shard in SHARDS:
                    assert http.put(f"/v1/shards/{shard.shard_id}", content=shard.data).status_code == 201
            yield url
    finally:
        store.close()


def ask(url: str, body: Any, scope: str | None = "read") -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60, headers=bearer(scope) if scope else {}) as http:
        return http.post(ROUTE, json=body)


def span(shard: Shard, offset: int, length: int) -> dict[str, Any]:
    return {"shard_id": shard.shard_id, "offset": offset, "length": length}


def test_ranges_of_many_shards_come_back_to_back_in_the_order_asked(server: str) -> None:
    wanted = [
        span(SHARDS[2], 10, 100),
        span(SHARDS[0], 0, len(SHARDS[0].data)),  # a whole shard
        span(SHARDS[1], len(SHARDS[1].data) - 1, 1),  # its last byte
        span(SHARDS[2], 3, 5),  # the same shard again, overlapping an earlier range
    ]
    answer = ask(server, {"ranges": wanted})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/octet-stream"
    expected = b"".join(
        next(s for s in SHARDS if s.shard_id == r["shard_id"]).data[r["offset"] :][: r["length"]] for r in wanted
    )
    assert answer.headers["content-length"] == str(len(expected))
    assert answer.content == expected


def test_a_batch_needs_a_read_token(server: str) -> None:
    answer = ask(server, {"ranges": [span(SHARDS[0], 0, 4)]}, scope=None)
    assert answer.status_code == 401 and is_json_error(answer)


ABSENT = "cd" * 32
BAD_BATCHES: list[tuple[str, Any, int, str]] = [
    ("no ranges", {"ranges": []}, 422, "ranges"),
    ("not a list", {"ranges": "all"}, 422, "ranges"),
    ("no body field", {}, 422, "ranges"),
    ("unknown field", {"ranges": [span(SHARDS[0], 0, 4)], "extra": 1}, 422, "extra"),
    ("unknown range field", {"ranges": [{**span(SHARDS[0], 0, 4), "x": 1}]}, 422, "x"),
    (
        "uppercase shard id",
        {"ranges": [{**span(SHARDS[0], 0, 4), "shard_id": SHARDS[0].shard_id.upper()}]},
        422,
        "shard_id",
    ),
    ("traversal as shard id", {"ranges": [{**span(SHARDS[0], 0, 4), "shard_id": "../../etc/passwd"}]}, 422, "shard_id"),
    ("negative offset", {"ranges": [span(SHARDS[0], -1, 4)]}, 422, "offset"),
    ("offset as a string", {"ranges": [{**span(SHARDS[0], 0, 4), "offset": "0"}]}, 422, "offset"),
    ("offset past int64", {"ranges": [span(SHARDS[0], 2**63, 4)]}, 422, "offset"),
    ("empty range", {"ranges": [span(SHARDS[0], 0, 0)]}, 422, "length"),
    ("range over the byte limit", {"ranges": [span(SHARDS[0], 0, MAX_BATCH_BYTES + 1)]}, 422, "length"),
    ("too many ranges", {"ranges": [span(SHARDS[0], 0, 1)] * (MAX_RANGES + 1)}, 422, "ranges"),
    ("total over the byte limit", {"ranges": [span(SHARDS[0], 0, MAX_BATCH_BYTES)] * 2}, 413, "at most"),
    (
        "shard not stored",
        {"ranges": [span(SHARDS[0], 0, 4), {"shard_id": ABSENT, "offset": 0, "length": 1}]},
        404,
        ABSENT,
    ),
    (
        "range past the end",
        {"ranges": [span(SHARDS[1], 0, 4), span(SHARDS[0], 1, len(SHARDS[0].data))]},
        416,
        "range 1",
    ),
    ("start past the end", {"ranges": [span(SHARDS[0], len(SHARDS[0].data), 1)]}, 416, "past the end"),
]


@pytest.mark.parametrize(("body", "status", "named"), [c[1:] for c in BAD_BATCHES], ids=[c[0] for c in BAD_BATCHES])
def test_a_bad_batch_is_a_clear_4xx(server: str, body: Any, status: int, named: str) -> None:
    answer = ask(server, body)
    assert answer.status_code == status, answer.text
    assert is_json_error(answer)
    assert named in answer.json()["message"]


def test_a_body_that_is_not_json_is_refused(server: str) -> None:
    with httpx.Client(base_url=server, timeout=60, headers=bearer("read")) as http:
        answer = http.post(ROUTE, content=b"\x00\x01", headers={"Content-Type": "application/json"})
    assert 400 <= answer.status_code < 500 and is_json_error(answer)


class BlobsOnly:
    """The one method of a Store that stream_batch uses, over a MemoryBlobStore."""

    def __init__(self, blobs: MemoryBlobStore) -> None:
        self.blobs = blobs

    def iter_shard(self, shard_id: str, offset: int, length: int, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        return self.blobs.iter_range(shard_id, offset, length, chunk_bytes)


def test_a_batch_streams_in_pieces_of_at_most_the_chunk_and_keeps_none_it_has_yielded(tmp_path: Path) -> None:
    blobs, shard = MemoryBlobStore(), SHARDS[0]
    (tmp_path / "shard").write_bytes(shard.data)
    blobs.put_file(shard.shard_id, tmp_path / "shard")
    rng = random.Random(5)
    ranges = [ByteRange(shard.shard_id, rng.randrange(100), rng.choice([1, 5, 30, 64, 65, 150])) for _ in range(40)]
    received = []
    for piece in stream_batch(BlobsOnly(blobs), ranges, 64):  # type: ignore[arg-type]
        # A server counts the pieces of an answer it holds: once it lets one go, nothing may keep it.
        assert sys.getrefcount(piece) == 2  # ``piece`` and getrefcount's argument
        assert 0 < len(piece) <= 64
        received.append(bytes(piece))
    assert b"".join(received) == b"".join(shard.data[r.offset : r.offset + r.length] for r in ranges)
