"""Shard uploads through the client's bulk HTTP path, against a real uvicorn server.

The client streams a shard's header and tensor bytes from memory; the server checks the
header and id first and hashes every tensor as it arrives. Refusals that come while the
client is still sending (a wrong token, a shard over the size limit, a misnamed shard)
must reach the client as the right error, and leave nothing stored or staged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.errors import AuthenticationError, IntegrityError, PayloadTooLargeError, PermissionDeniedError
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import READ_TOKEN, TOKENS, WRITE_TOKEN, files_under
from tests.servers import running_server
from tests.service.shardkit import RawTensor, build_shard

#: Big enough that the server answers long before the client has sent it all.
BIG = [RawTensor("U8", (24 << 20,), os.urandom(24 << 20)), RawTensor("F32", (1 << 20,), os.urandom(4 << 20))]
SHARD = build_shard(BIG)
HEADER = SHARD.data[: SHARD.header_length]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Store]]:
    """A server with tokens and a 16 MiB shard limit over a fresh embedded store."""
    store = Store.open_home(tmp_path / "home")
    settings = Settings(home=tmp_path / "home", tokens=TOKENS, max_shard_bytes=16 << 20)
    try:
        with running_server(create_app(store, settings)) as url:
            yield url, store
    finally:
        store.close()


def untouched(store: Store) -> None:
    """Nothing stored, nothing staged."""
    assert list(store.blobs.list_ids()) == []
    assert files_under(store.staging_dir) == set()


def test_a_shard_streamed_from_memory_is_stored_verified(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    with running_server(create_app(store, Settings(home=tmp_path / "home", tokens=TOKENS))) as url:
        transport = HttpTransport(url, WRITE_TOKEN)
        try:
            sent: list[int] = []
            receipt = transport.put_shard(HEADER, [memoryview(t.data) for t in BIG], sent.append)
            assert (receipt.shard_id, receipt.size, receipt.created) == (SHARD.shard_id, len(SHARD.data), True)
            assert sum(sent) == sum(len(t.data) for t in BIG)
            again = transport.put_shard(HEADER, [memoryview(t.data) for t in BIG])
            assert again.created is False  # the keep-alive connection was reused for a second upload
        finally:
            transport.close()
    buffer = bytearray(len(SHARD.data))
    store.read_into(SHARD.shard_id, 0, memoryview(buffer))
    assert bytes(buffer) == SHARD.data
    store.close()


@pytest.mark.parametrize(
    ("token", "error", "message"),
    [(None, AuthenticationError, "token"), (READ_TOKEN, PermissionDeniedError, "write")],
    ids=["no-token", "read-token"],
)
def test_a_refused_token_arrives_as_its_error_while_the_body_is_still_being_sent(
    served: tuple[str, Store], token: str | None, error: type[Exception], message: str
) -> None:
    url, store = served
    transport = HttpTransport(url, token, retries=0)
    try:
        with pytest.raises(error, match=message):
            transport.put_shard(HEADER, [memoryview(t.data) for t in BIG])
    finally:
        transport.close()
    untouched(store)


def test_a_shard_over_the_limit_is_refused_from_its_length_and_nothing_is_kept(served: tuple[str, Store]) -> None:
    url, store = served
    transport = HttpTransport(url, WRITE_TOKEN, retries=0)
    try:
        with pytest.raises(PayloadTooLargeError, match="exceeds the limit"):
            transport.put_shard(HEADER, [memoryview(t.data) for t in BIG])
    finally:
        transport.close()
    untouched(store)


def test_bytes_changed_after_hashing_are_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    with running_server(create_app(store, Settings(home=tmp_path / "home", tokens=TOKENS))) as url:
        transport = HttpTransport(url, WRITE_TOKEN, retries=0)
        changed = bytearray(BIG[0].data)
        changed[len(changed) // 2] ^= 0x10
        try:
            with pytest.raises(IntegrityError, match="hashes to"):
                transport.put_shard(HEADER, [memoryview(changed), memoryview(BIG[1].data)])
            # The connection the refusal closed is not reused: the next upload succeeds.
            assert transport.put_shard(HEADER, [memoryview(t.data) for t in BIG]).created is True
        finally:
            transport.close()
    store.close()
