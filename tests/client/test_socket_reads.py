"""Ranged reads of :class:`client.http.bulk.BulkHttp` straight from the socket (``MSG_WAITALL``),
against a real TCP server on loopback that answers each request as a script says: the body split
at points Hypothesis draws (some of it arriving with the headers), cut short, too long, or
stalled after the headers.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.client.http.bulk import BulkHttp
from ckptstore.client.http.route import Route
from ckptstore.service.errors import IntegrityError
from ckptstore.service.receive_mark import LOW_WATER

#: How one request is answered: given the connected socket, send what the script says.
Answer = Callable[[socket.socket], None]


def read_head(sock: socket.socket) -> bytes:
    """A request's head, read a byte at a time (the request has no body)."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        if not byte:
            return b""
        head += byte
    return head


@contextmanager
def scripted_server(answers: list[Answer]) -> Iterator[tuple[str, list[int]]]:
    """A loopback server answering successive requests with ``answers`` (on any connection);
    yields its URL and, per request, the number of the connection it came on."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[int] = []
    pending = list(answers)
    stop = threading.Event()

    def serve(sock: socket.socket, number: int) -> None:
        with sock:
            while pending and read_head(sock):
                connections.append(number)
                pending.pop(0)(sock)

    def accept() -> None:
        number = 0
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=serve, args=(sock, number), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", connections
    finally:
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept under way
        listener.close()
        thread.join(10)


def body_answer(body: bytes, splits: list[int], declared: int | None = None, status: int = 206) -> Answer:
    """Send the head and ``body`` in pieces cut at ``splits`` (the first piece with the head)."""

    def answer(sock: socket.socket) -> None:
        length = len(body) if declared is None else declared
        head = f"HTTP/1.1 {status} Partial Content\r\nContent-Length: {length}\r\n\r\n".encode()
        cuts = [0, *sorted(set(splits)), len(body)]
        pieces = [body[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        sock.sendall(head + pieces[0])
        for piece in pieces[1:]:
            sock.sendall(piece)

    return answer


def bulk(url: str, timeout: float = 30.0) -> BulkHttp:
    return BulkHttp(Route(url=url, proxy=None, tls=None), {}, timeout)


@settings(max_examples=40, deadline=None)
@given(
    body=st.binary(min_size=1, max_size=300_000),
    data=st.data(),
)
def test_a_body_fills_the_buffers_exactly_wherever_its_pieces_break(body: bytes, data: st.DataObject) -> None:
    splits = data.draw(st.lists(st.integers(0, len(body)), max_size=5))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(body) - 1), max_size=4)))) if len(body) > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    buffers = [memoryview(bytearray(size)) for size in sizes]
    with scripted_server([body_answer(body, splits), body_answer(body[::-1], [])]) as (url, connections):
        wire = bulk(url)
        assert wire.get_into("/x", {}, buffers).status_code == 206
        assert b"".join(bytes(buffer) for buffer in buffers) == body
        again = memoryview(bytearray(len(body)))
        assert wire.get_into("/x", {}, [again]).status_code == 206
        assert bytes(again) == body[::-1]
        wire.close()
    assert connections == [1, 1]  # the connection went back to the pool, its framing intact


def test_a_body_cut_short_is_an_incomplete_read() -> None:
    def cut(sock: socket.socket) -> None:
        body_answer(b"a" * 1000, [10], declared=5000)(sock)
        sock.shutdown(socket.SHUT_WR)

    with scripted_server([cut]) as (url, _):
        with pytest.raises(http.client.IncompleteRead):
            bulk(url).get_into("/x", {}, [memoryview(bytearray(5000))])


def test_a_body_longer_than_the_buffers_is_refused() -> None:
    with scripted_server([body_answer(b"b" * 2000, [7])]) as (url, _):
        with pytest.raises(IntegrityError, match="sent 2000 bytes"):
            bulk(url).get_into("/x", {}, [memoryview(bytearray(1000))])


def test_a_server_that_stalls_mid_body_times_out_and_the_socket_keeps_its_timeout() -> None:
    release = threading.Event()

    def stall(sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100000\r\n\r\n" + b"c" * 100)
        release.wait(30)

    with scripted_server([stall]) as (url, _):
        wire = bulk(url, timeout=0.5)
        with pytest.raises(TimeoutError):
            wire.get_into("/x", {}, [memoryview(bytearray(100_000))])
        release.set()


def test_the_socket_is_left_as_it_was_found_for_the_next_request() -> None:
    seen: list[float | None] = []
    with scripted_server([body_answer(b"d" * 70_000, [3, 40_000]), body_answer(b"e" * 10, [])]) as (url, _):
        wire = bulk(url, timeout=7.0)
        wire.get_into("/x", {}, [memoryview(bytearray(70_000))])
        connection, _ = wire._idle[0]
        assert connection.sock is not None
        seen.append(connection.sock.gettimeout())
        assert connection.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == bytes(16)
        wire.get_into("/x", {}, [memoryview(bytearray(10))])
    assert seen == [7.0]


def test_a_slow_last_piece_of_a_large_body_is_read_as_it_comes_not_at_the_timeout() -> None:
    # The tail is fewer bytes than the low-water mark: on a kernel that wakes a reader only once
    # the mark's bytes wait, a mark left up would keep them waiting out the 20 s receive timeout.
    body = bytes(range(256)) * ((3 * LOW_WATER) // 256) + b"tail"
    sent_tail = threading.Event()

    def slow_tail(sock: socket.socket) -> None:
        sock.sendall(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:-4])
        sent_tail.wait(0.3)  # a server whose last bytes come late (nothing sets the event)
        sock.sendall(body[-4:])

    buffers = [memoryview(bytearray(LOW_WATER)), memoryview(bytearray(len(body) - LOW_WATER))]
    with scripted_server([slow_tail]) as (url, _):
        wire = bulk(url, timeout=20.0)
        started = time.monotonic()
        assert wire.get_into("/x", {}, buffers).status_code == 206
        assert time.monotonic() - started < 10
        assert b"".join(bytes(b) for b in buffers) == body
        connection, _ = wire._idle[0]
        assert connection.sock is not None
        assert connection.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1  # left as found
        wire.close()
