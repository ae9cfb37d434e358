"""Tensors sent unhashed to a real server (``POST /v1/shards``), which hashes them as it writes them.

The client's :meth:`HttpTransport.put_tensors` against uvicorn on a fresh store: any mix of
dtypes, shapes and repeated tensors comes back with the digests computed here, stored once
each and readable; hostile bodies are refused with a 4xx naming the problem and leave nothing
stored or staged; a server without the route gets hashed shards instead.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore.client.http.transport as http_transport
from ckptstore.client import Client
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.api.http.socket_body import MIN_BODY_BYTES
from ckptstore.service.errors import InvalidInputError, PermissionDeniedError
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.dtypes import DTYPES, byte_length
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import READ_TOKEN, TOKENS, WRITE_TOKEN, eventually, files_under
from tests.client.models import TinyNet, same_state
from tests.client.upload_gate import SmallShardFirst
from tests.servers import running_server

LIMIT = 64 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Store]]:
    """A server with tokens and a 64 MiB shard limit over a fresh embedded store."""
    home = tmp_path_factory.mktemp("unhashed") / "home"
    store = Store.open_home(home)
    try:
        with running_server(create_app(store, Settings(home=home, tokens=TOKENS, max_shard_bytes=LIMIT))) as url:
            yield url, store
    finally:
        store.close()


def unhashed(dtype: str, shape: tuple[int, ...], data: bytes) -> UnhashedTensor:
    return UnhashedTensor(dtype, shape, memoryview(data))


def stored_bytes(store: Store, digest: str) -> bytes:
    location = store.locate([digest])[digest]
    buffer = bytearray(location.nbytes)
    store.read_into(location.shard_id, location.offset, memoryview(buffer))
    return bytes(buffer)


tensors = st.lists(
    st.tuples(
        st.sampled_from(sorted(DTYPES)),
        st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
        st.integers(0, 3),  # seed: equal seeds of equal dtype and shape are equal tensors
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=tensors)
def test_any_mix_of_tensors_is_hashed_by_the_server_stored_once_each_and_readable(
    served: tuple[str, Store], drawn: list[tuple[str, tuple[int, ...], int]]
) -> None:
    url, store = served
    given_tensors = []
    for dtype, shape, seed in drawn:
        size = byte_length(dtype, list(shape))
        given_tensors.append(unhashed(dtype, shape, bytes((seed * 7 + i) % 256 for i in range(size))))
    transport = HttpTransport(url, token=WRITE_TOKEN)
    try:
        receipt, digests = transport.put_tensors(given_tensors)
        assert transport.takes_unhashed
    finally:
        transport.close()
    expected = [tensor_digest(t.dtype, t.shape, t.data) for t in given_tensors]
    assert digests == expected
    assert receipt.tensors == len(set(expected))
    for tensor, digest in zip(given_tensors, digests, strict=True):
        assert stored_bytes(store, digest) == bytes(tensor.data)
    assert files_under(store.staging_dir) == set()


def test_a_large_upload_read_from_the_socket_is_stored_and_sent_again_is_known(served: tuple[str, Store]) -> None:
    url, store = served
    big = [unhashed("U8", (MIN_BODY_BYTES,), os.urandom(MIN_BODY_BYTES)), unhashed("F32", (1000,), os.urandom(4000))]
    transport = HttpTransport(url, token=WRITE_TOKEN)
    try:
        first, digests = transport.put_tensors(big)
        again, digests_again = transport.put_tensors(big)
    finally:
        transport.close()
    assert first.created and not again.created and first.shard_id == again.shard_id
    assert digests == digests_again == [tensor_digest(t.dtype, t.shape, t.data) for t in big]
    assert stored_bytes(store, digests[0]) == bytes(big[0].data)


def post(url: str, body: bytes, token: str = WRITE_TOKEN, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as http:
        return http.post("/v1/shards", content=body, headers={"Authorization": f"Bearer {token}", **headers})


def layout(entries: object) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (struct.pack("<Q", 1 << 40), "layout is"),
        (struct.pack("<Q", 5) + b"[[1,2" + bytes(8), "not valid JSON"),
        (layout({"F32": [2]}) + bytes(8), "non-empty list"),
        (layout([]), "non-empty list"),
        (layout([["F99", [2]]]) + bytes(8), "known dtype"),
        (layout([["F32", [-1]]]), "invalid shape"),
        (layout([["F32", [True, 2]]]) + bytes(8), "invalid shape"),
        (layout([["F32", [2.0]]]) + bytes(8), "invalid shape"),
        (layout([["F32", [2] * 65]]), "invalid shape"),
        (layout([["F32", [0]]]), "empty"),
        (layout([["U8", [1]]] * 50_001), "at most 50000"),
        (layout([["F32", [2]]]) + bytes(7), "body is"),
        (layout([["F32", [2]]]) + bytes(9), "body is"),
        (layout([["U8", [1 << 40]]]), "exceeds the limit"),
        (layout([["U8", [4]], ["U8", [4]]]) + b"abcdabcd", "tensors 0 and 1 of the upload are equal"),
    ],
)
def test_a_hostile_upload_is_refused_naming_the_problem_and_leaves_nothing(
    served: tuple[str, Store], body: bytes, says: str
) -> None:
    url, store = served
    before = set(store.blobs.list_ids())
    response = post(url, body)
    assert 400 <= response.status_code < 500, response.text
    assert says in response.json()["message"]
    assert set(store.blobs.list_ids()) == before and files_under(store.staging_dir) == set()


def test_an_upload_without_a_length_or_a_write_token_is_refused(served: tuple[str, Store]) -> None:
    url, _ = served
    body = layout([["U8", [3]]]) + b"abc"
    refused = post(url, body, READ_TOKEN)
    assert refused.status_code == 403 and refused.headers["x-error-code"] == PermissionDeniedError.code

    def chunks() -> Iterator[bytes]:
        yield body  # a generator body goes chunked, with no Content-Length

    with httpx.Client(base_url=url, timeout=60) as http:
        chunked = http.post("/v1/shards", content=chunks(), headers={"Authorization": f"Bearer {WRITE_TOKEN}"})
    assert chunked.status_code == 400 and "Content-Length" in chunked.json()["message"]
    assert chunked.headers["x-error-code"] == InvalidInputError.code


def test_a_save_to_a_server_without_the_route_hashes_its_tensors_first(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    app = create_app(store, Settings(home=tmp_path / "home", tokens=TOKENS))

    async def older(scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The app as a server that predates unhashed uploads answers their routes: 404."""
        if scope["type"] == "http" and scope["path"] in {"/v1/shards", "/v1/tensors/sizes"}:
            body = json.dumps({"code": "not_found", "message": "Not Found"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 404, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    saved, loaded = TinyNet(), TinyNet()
    try:
        with running_server(older) as url, Client(url, token=WRITE_TOKEN) as client:  # type: ignore[arg-type]
            client.save("run", saved)
            assert isinstance(client.transport, HttpTransport) and not client.transport.takes_unhashed
            client.load("run", model=loaded)
    finally:
        store.close()
    assert same_state(saved.state_dict(), loaded.state_dict())


def test_a_first_save_asks_about_sizes_once_the_next_not_at_all_and_both_send_unhashed(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    app = create_app(store, Settings(home=tmp_path / "home", tokens=TOKENS))
    asked: list[str] = []

    async def counting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            asked.append(f"{scope['method']} {scope['path']}")
        await app(scope, receive, send)

    def model() -> torch.nn.Module:  # tensors of sizes of their own: none needs hashing first
        return torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 300))

    saved, loaded = model(), model()
    try:
        with running_server(counting) as url, Client(url, token=WRITE_TOKEN) as client:  # type: ignore[arg-type]
            client.save("run", saved)
            first = list(asked)
            with torch.no_grad():
                for param in saved.parameters():
                    param.mul_(2)  # every tensor changed in place, each of a size the first version holds
            asked.clear()
            client.save("run", saved)
            second = list(asked)
            client.load("run", model=loaded)
    finally:
        store.close()
    assert first.count("POST /v1/tensors/sizes") == 1, first
    assert "POST /v1/shards" in first and "POST /v1/tensors/missing" not in first, first
    # The next save knows those sizes are held and its tensors changed: no question, sent unhashed.
    assert "POST /v1/tensors/sizes" not in second and "POST /v1/tensors/missing" not in second, second
    assert "POST /v1/shards" in second, second
    assert same_state(saved.state_dict(), loaded.state_dict())


SENDER = """
import socket, struct, sys, json
host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layout = json.dumps([["U8", [64 << 20]]]).encode()
body_head = struct.pack("<Q", len(layout)) + layout
request = (
    f"POST /v1/shards HTTP/1.1\\r\\nHost: t\\r\\nAuthorization: Bearer {token}\\r\\n"
    f"Content-Length: {len(body_head) + (64 << 20)}\\r\\n\\r\\n"
).encode()
sock = socket.create_connection((host, port))
sock.sendall(request + body_head + bytes(16 << 20))
print("sent", flush=True)
sys.stdin.read()  # killed here, a quarter of the body sent
"""


@pytest.mark.parametrize("cut", ["kill", "close"])
def test_a_sender_gone_mid_upload_leaves_nothing_stored_or_staged(served: tuple[str, Store], cut: str) -> None:
    url, store = served
    host, port = url.removeprefix("http://").split(":")
    before = set(store.blobs.list_ids())
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, host, port, WRITE_TOKEN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout is not None and sender.stdout.readline().strip() == "sent"
        assert eventually(lambda: files_under(store.staging_dir) != set())  # the upload is being staged
        if cut == "kill":
            sender.kill()
        else:
            sender.communicate("", timeout=30)  # the sender exits, closing its socket
    finally:
        if sender.poll() is None:
            sender.kill()
        sender.wait()
    assert eventually(lambda: files_under(store.staging_dir) == set())  # the server notices the hang-up
    assert set(store.blobs.list_ids()) == before
    transport = HttpTransport(url, token=WRITE_TOKEN)
    try:  # and the server takes the next upload as before
        receipt, _ = transport.put_tensors([unhashed("U8", (5,), cut.encode().ljust(5))])
    finally:
        transport.close()
    assert receipt.created


def test_a_save_through_a_server_sends_its_small_tensors_beside_the_large_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one upload in flight, a large tensors' upload here waits until the server has taken
    the small tensors' shard: it goes on a connection of its own, not after the large ones."""
    torch.manual_seed(0)
    saved, loaded = (torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)) for _ in range(2))
    gate = SmallShardFirst(HttpTransport.put_tensors, 64 << 10)  # the biases are small
    monkeypatch.setattr(HttpTransport, "put_tensors", gate)
    monkeypatch.setattr(http_transport, "HTTP_UPLOADS_IN_FLIGHT", 1)
    store = Store.open_home(tmp_path / "home")
    try:
        app = create_app(store, Settings(home=tmp_path / "home", tokens=TOKENS))
        with running_server(app) as url, Client(url, token=WRITE_TOKEN, shard_bytes=256 << 10) as ckpt:
            result = ckpt.save("run", saved)
            ckpt.load("run", model=loaded)
    finally:
        store.close()
    assert sorted(gate.sent) == ["large", "large", "small"] and result.shards == 3
    assert same_state(saved.state_dict(), loaded.state_dict())
