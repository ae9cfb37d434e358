"""Downloads sent from the blob files by the kernel (``sendfile``), against a real uvicorn server
over a local blob folder, and the sender itself over a real socket pair.

Every byte is compared with Python slicing of the shards' real bytes, for ranges Hypothesis
draws, with ``CKPTSTORE_SENDFILE`` on and off; keep-alive framing is checked on a raw socket
(two pipelined requests and a third after them on one connection); a client that hangs up
mid-answer leaves no descriptor open; and the sender's edges (a file shorter than recorded, a
peer gone, a socket with no room) are driven on a socket pair with real files.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.api import create_app
from ckptstore.service.api.http import sendfile
from ckptstore.service.api.http.sendfile import FileSpans, SegmentSender
from ckptstore.service.errors import NotFoundError, StorageError
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, bearer, build_shard, tensor
from tests.servers import running_server

SHARDS = [
    build_shard(tensor(41, "U8", (3 << 20,))),  # larger than a socket's buffer: sends resume
    build_shard(tensor(42, "F32", (97, 101)), tensor(43, "U8", (4_999,))),
]
READ = bearer("read")


@pytest.fixture(scope="module", params=["sendfile", "streamed"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server on a local blob folder holding SHARDS, sending with sendfile or streaming pieces."""
    home = tmp_path_factory.mktemp(f"sendfile-{request.param}")
    store = Store.open_home(home)
    settings_ = Settings(home=home, tokens=TOKENS, sendfile=request.param == "sendfile")
    try:
        with running_server(create_app(store, settings_), settings_) as url:
            for shard in SHARDS:
                put = httpx.put(f"{url}/v1/shards/{shard.shard_id}", content=shard.data, headers=bearer("write"))
                assert put.status_code == 201, put.text
            yield url
    finally:
        store.close()


def open_fds() -> set[str]:
    """This process's open descriptors (the in-process server's among them)."""
    return set(os.listdir("/proc/self/fd"))


spans = st.lists(
    st.integers(0, len(SHARDS) - 1).flatmap(
        lambda index: st.integers(0, len(SHARDS[index].data) - 1).flatmap(
            lambda offset: st.tuples(st.just(index), st.just(offset), st.integers(1, len(SHARDS[index].data) - offset))
        )
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spans)
def test_range_batches_are_the_shards_bytes_in_the_order_asked(server: str, picked: list[tuple[int, int, int]]) -> None:
    body = {
        "ranges": [{"shard_id": SHARDS[i].shard_id, "offset": offset, "length": length} for i, offset, length in picked]
    }
    answer = httpx.post(f"{server}/v1/shards/ranges", json=body, headers=READ, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.content == b"".join(SHARDS[i].data[offset : offset + length] for i, offset, length in picked)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, len(SHARDS[0].data) - 1), st.integers(1, len(SHARDS[0].data)))
def test_ranged_gets_are_the_shards_bytes(server: str, start: int, length: int) -> None:
    shard = SHARDS[0]
    end = min(start + length, len(shard.data)) - 1
    answer = httpx.get(
        f"{server}/v1/shards/{shard.shard_id}", headers={**READ, "Range": f"bytes={start}-{end}"}, timeout=60
    )
    assert answer.status_code == 206
    assert answer.headers["content-range"] == f"bytes {start}-{end}/{len(shard.data)}"
    assert answer.content == shard.data[start : end + 1]


def read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP/1.1 answer with a Content-Length read off ``sock``: its head and its body."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += sock.recv(1)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(min(1 << 20, length - len(body)))
        assert chunk, "the connection closed mid-answer"
        body += chunk
    return head, bytes(body)


def test_answers_keep_the_connection_framed_for_the_requests_after_them(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    big, small = SHARDS
    requests = [
        f"GET /v1/shards/{big.shard_id} HTTP/1.1\r\nHost: t\r\nAuthorization: {READ['Authorization']}\r\n\r\n",
        f"GET /v1/shards/{small.shard_id} HTTP/1.1\r\nHost: t\r\nAuthorization: {READ['Authorization']}\r\n"
        "Range: bytes=-100\r\n\r\n",
    ]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall("".join(requests).encode())  # pipelined: the second waits behind the first's body
        head, body = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == big.data
        head, body = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 206") and body == small.data[-100:]
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")  # and the connection still serves
        head, _ = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 200")


def test_a_client_hanging_up_mid_answer_leaves_no_descriptor_open(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    shard = SHARDS[0]
    with httpx.Client(base_url=server, headers=READ, timeout=60) as http:  # warm: the pool's threads exist
        assert http.get(f"/v1/shards/{shard.shard_id}").content == shard.data
    before = open_fds()
    for _ in range(10):
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        head = f"GET /v1/shards/{shard.shard_id} HTTP/1.1\r\nHost: t\r\nAuthorization: {READ['Authorization']}\r\n"
        sock.sendall(head.encode() + b"\r\n")
        assert sock.recv(12) == b"HTTP/1.1 200"
        sock.close()  # with most of the body unsent
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=server, headers=READ, timeout=60) as http:
        # The server notices each hang-up on its own; it keeps answering meanwhile.
        while not open_fds() <= before and time.monotonic() < deadline:
            assert http.get(f"/v1/shards/{shard.shard_id}").content == shard.data
    left = open_fds() - before
    assert not left, sorted(left)


# -- the sender on a socket pair ---------------------------------------------------------------


def written(tmp_path: Path, data: bytes) -> int:
    """A read-only descriptor of a new file holding ``data``."""
    path = tmp_path / f"blob-{len(list(tmp_path.iterdir()))}"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


@contextmanager
def sending_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected socket pair: the sending end non-blocking, as a server's connection is."""
    out, peer = socket.socketpair()
    with out, peer:
        out.setblocking(False)
        yield out, peer


def drain(sock: socket.socket, size: int, into: bytearray) -> threading.Thread:
    """A thread reading ``size`` bytes of ``sock`` into ``into``."""

    def run() -> None:
        while len(into) < size and (chunk := sock.recv(1 << 20)):
            into.extend(chunk)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_sender_moves_segments_of_several_files_in_order(tmp_path: Path) -> None:
    first, second = os.urandom(5 << 20), os.urandom(70_001)
    fds = {"a": written(tmp_path, first), "b": written(tmp_path, second)}
    wanted = [("a", 10, 3 << 20), ("b", 0, 70_001), ("a", 0, 1), ("a", (5 << 20) - 7, 7)]
    opened = []

    def opener(blob_id: str) -> int:
        opened.append(blob_id)
        return os.dup(fds[blob_id])

    with sending_pair() as (out, peer):
        got = bytearray()
        size = sum(length for _, _, length in wanted)
        reader = drain(peer, size, got)
        files = FileSpans(opener, wanted)
        sender = SegmentSender(out.fileno(), files, lambda: False)
        while not sender.run(0.05):
            pass
        files.close()
        reader.join(30)
    assert sender.sent == size
    expected = {"a": first, "b": second}
    assert bytes(got) == b"".join(expected[blob][offset : offset + length] for blob, offset, length in wanted)
    assert opened == ["a", "b", "a"]  # one open per run of spans of the same blob
    for fd in fds.values():
        os.close(fd)


def test_a_file_shorter_than_its_segment_is_a_storage_error(tmp_path: Path) -> None:
    fd = written(tmp_path, b"x" * 1000)
    with sending_pair() as (out, peer):
        sender = SegmentSender(out.fileno(), [(fd, 0, 1001)], lambda: False)
        with pytest.raises(StorageError, match="1 bytes before its recorded size"):
            sender.run(0.05)
        assert peer.recv(2000) == b"x" * 1000  # what it had was sent; the caller resets the connection
    os.close(fd)


def test_a_peer_gone_is_a_connection_reset_and_a_full_socket_hands_the_wait_back(tmp_path: Path) -> None:
    fd = written(tmp_path, os.urandom(8 << 20))
    with sending_pair() as (out, peer):
        sender = SegmentSender(out.fileno(), [(fd, 0, 8 << 20)], lambda: False)
        assert sender.run(0.01) is False  # the peer reads nothing: the socket fills up
        assert 0 < sender.sent < 8 << 20
        peer.close()
        with pytest.raises(ConnectionResetError):
            sender.run(0.01)
    os.close(fd)


def test_a_stopped_answer_sends_no_more(tmp_path: Path) -> None:
    fd = written(tmp_path, b"y" * 100)
    with sending_pair() as (out, _):
        with pytest.raises(ConnectionResetError):
            SegmentSender(out.fileno(), [(fd, 0, 100)], lambda: True).run(0.05)
    os.close(fd)


def test_file_spans_close_what_they_opened_whether_or_not_iteration_ran(tmp_path: Path) -> None:
    fd = written(tmp_path, b"z" * 10)
    before = open_fds()
    untouched = FileSpans(lambda blob: os.dup(fd), [("b", 0, 5)], opened=("a", os.dup(fd)))
    untouched.close()
    halfway = FileSpans(lambda blob: os.dup(fd), [("a", 0, 5), ("b", 0, 5), ("c", 0, 5)])
    segments = iter(halfway)
    next(segments)
    next(segments)
    halfway.close()
    never_sent = FileSpans(lambda blob: os.dup(fd), [("a", 0, 5)], opened=("a", os.dup(fd)))
    del never_sent  # built for an answer that was never sent: its file goes with it
    assert open_fds() == before
    with pytest.raises(StorageError, match="not a local file"):
        list(FileSpans(lambda blob: None, [("a", 0, 5)]))
    os.close(fd)


def test_the_extension_is_offered_on_plain_tcp_only() -> None:
    class Transport:
        def __init__(self, extra: dict[str, object]) -> None:
            self.extra = extra

        def get_extra_info(self, name: str) -> object:
            return self.extra.get(name)

    plain: dict[str, object] = {}
    sendfile.offer(Transport({"socket": object()}), plain)
    assert sendfile.offered(plain)
    tls: dict[str, object] = {}
    sendfile.offer(Transport({"socket": object(), "ssl_object": object()}), tls)
    assert not sendfile.offered(tls)


def test_a_file_gone_mid_answer_resets_the_connection_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = os.urandom(1000)
    fd = written(tmp_path, first)

    def opener(blob_id: str) -> int:
        if blob_id == "gone":
            raise NotFoundError("blob gone is missing")
        return os.dup(fd)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert sendfile.offered(scope)
        spans = FileSpans(opener, [("here", 0, 1000), ("gone", 0, 1000)])
        await sendfile.FileAnswer(spans, 200, {"Content-Length": "2000"})(scope, receive, send)

    settings_ = Settings(home=tmp_path, tokens=TOKENS)
    with caplog.at_level(logging.WARNING, logger="ckptstore.server"):
        with running_server(app, settings_) as url:  # type: ignore[arg-type]
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                received = b""
                try:
                    while chunk := sock.recv(1 << 16):
                        received += chunk
                except ConnectionResetError:
                    pass
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-length: 2000" in head.lower()
    assert body == first  # the bytes that could be sent, then the end: never wrong bytes
    assert any("could not be read whole" in record.getMessage() for record in caplog.records)
    os.close(fd)
