"""Ranged shard reads over HTTP land straight in the caller's buffers, and every wrong answer is caught.

A hand-written server sends canned answers byte for byte, so bodies that a real server
never sends (too short, too long, cut off, whole file instead of a range) can be tested.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ckptstore import client
from ckptstore.client.http.transport import HttpTransport

SHARD = "ab" * 32
DATA = bytes(range(16))


@contextmanager
def canned_server(answers: list[bytes]) -> Iterator[tuple[str, list[bytes]]]:
    """A loopback server answering the n-th connection's request with ``answers[n]``, then hanging up.

    Yields its URL and the requests it received.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    requests: list[bytes] = []

    def serve() -> None:
        for answer in answers:
            connection, _ = listener.accept()
            with connection:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += connection.recv(4096)
                requests.append(request)
                connection.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", requests
    finally:
        listener.close()
        thread.join(timeout=10)


def answer(status: str, body: bytes, *, length: int | None = None, chunked: bool = False, extra: str = "") -> bytes:
    if chunked:
        framing = "Transfer-Encoding: chunked\r\n"
        body = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 5]), body[i : i + 5]) for i in range(0, len(body), 5))
        body += b"0\r\n\r\n"
    else:
        framing = f"Content-Length: {len(body) if length is None else length}\r\n"
    return f"HTTP/1.1 {status}\r\n{framing}{extra}Connection: close\r\n\r\n".encode() + body


def read(url: str, buffers: list[bytearray], retries: int = 0) -> None:
    transport = HttpTransport(url, token="secret", retries=retries, backoff_seconds=0.001)
    try:
        transport.read_scatter(SHARD, 4, [memoryview(buffer) for buffer in buffers])
    finally:
        transport.close()


def test_a_range_fills_the_buffers_in_turn() -> None:
    with canned_server([answer("206 Partial Content", DATA)]) as (url, requests):
        buffers = [bytearray(3), bytearray(0), bytearray(13)]
        read(url, buffers)
    assert b"".join(buffers) == DATA
    (request,) = requests
    assert request.startswith(f"GET /v1/shards/{SHARD} HTTP/1.1\r\n".encode())
    assert b"\r\nRange: bytes=4-19\r\n" in request
    assert b"\r\nAuthorization: Bearer secret\r\n" in request
    assert b"\r\nUser-Agent: ckptstore/" in request


@pytest.mark.parametrize(
    ("body", "chunked", "message"),
    [
        (DATA[:10], False, "sent 10 bytes"),
        (DATA + b"more", False, "sent 20 bytes"),
        (DATA[:10], True, "ended after 10 of 16 bytes"),
        (DATA + b"more", True, "more than 16 bytes"),
    ],
)
def test_a_short_or_long_body_is_an_integrity_error(body: bytes, chunked: bool, message: str) -> None:
    with canned_server([answer("206 Partial Content", body, chunked=chunked)]) as (url, _):
        with pytest.raises(client.IntegrityError, match=message):
            read(url, [bytearray(16)])


def test_a_whole_file_instead_of_the_range_is_an_integrity_error() -> None:
    with canned_server([answer("200 OK", DATA)]) as (url, _):
        with pytest.raises(client.IntegrityError, match="ignored the byte range"):
            read(url, [bytearray(16)])


def test_a_cut_connection_is_retried() -> None:
    cut = answer("206 Partial Content", DATA[:8], length=16)
    with canned_server([cut, answer("206 Partial Content", DATA)]) as (url, requests):
        buffer = bytearray(16)
        read(url, [buffer], retries=1)
    assert buffer == DATA and len(requests) == 2


def test_a_connection_cut_every_time_is_a_storage_error() -> None:
    cut = answer("206 Partial Content", DATA[:8], length=16)
    with canned_server([cut, cut]) as (url, _):
        with pytest.raises(client.StorageError, match=f"reading shard {SHARD}"):
            read(url, [bytearray(16)], retries=1)


def test_busy_answers_are_retried() -> None:
    busy = answer("503 Service Unavailable", b"", extra="Retry-After: 0\r\n")
    with canned_server([busy, answer("429 Too Many Requests", b""), answer("206 Partial Content", DATA)]) as (url, _):
        buffer = bytearray(16)
        read(url, [buffer], retries=2)
    assert buffer == DATA


def test_an_error_answer_becomes_its_exception_and_leaves_the_buffer_alone() -> None:
    body = b'{"code": "not_found", "message": "shard abab is not in the store"}'
    missing = answer("404 Not Found", body, extra="X-Error-Code: not_found\r\nContent-Type: application/json\r\n")
    with canned_server([missing]) as (url, _):
        buffer = bytearray(b"x" * 16)
        with pytest.raises(client.NotFoundError, match="shard abab is not in the store"):
            read(url, [buffer])
    assert buffer == b"x" * 16
