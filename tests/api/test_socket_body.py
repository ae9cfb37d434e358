"""Large request bodies read from the socket by the app (service.api.http.socket_body), over a real uvicorn.

An ASGI app takes the body through :meth:`SocketBody.read_into` where the server offers it,
else through ``receive``, and answers with the SHA-256 of what it got and which way it came. Raw
sockets send bodies in random pieces, with ``Expect: 100-continue``, cut off, or chunked.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.api.http import socket_body
from ckptstore.service.api.http.socket_body import MIN_BODY_BYTES, RateWindow, offered
from ckptstore.service.errors import CheckpointError, InvalidInputError, RequestTimeoutError
from ckptstore.service.intake import direct_file
from ckptstore.service.intake.direct_file import BUFFER_BYTES
from ckptstore.service.receive_mark import LOW_WATER
from ckptstore.service.settings import Settings
from tests.servers import running_server

BIG = MIN_BODY_BYTES + BUFFER_BYTES + 12_345  # spans several buffers, the last one partial


class Spaces:
    """A landing for :meth:`SocketBody.read_into` that gives spaces of the sizes drawn, in turn,
    then of all its memory (the largest, at least 64 KiB); it may dwell on one piece (work on
    what landed, which the rate rule must not count)."""

    def __init__(self, sizes: list[int], consume: Callable[[memoryview], None], dwell: float = 0.0) -> None:
        self.sizes, self.turn, self.consume, self.dwell = sizes, 0, consume, dwell
        self.memory = memoryview(bytearray(max(*sizes, 1 << 16)))

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.consume(memoryview(data))

    def space(self) -> memoryview:
        return self.memory[: self.sizes[self.turn] if self.turn < len(self.sizes) else None]

    def landed(self, nbytes: int) -> None:
        self.turn += 1
        self.consume(self.memory[:nbytes])
        if self.dwell and self.turn == 1:
            threading.Event().wait(self.dwell)


class Pooled:
    """A landing that receives each piece into one buffer of the writers' pool and consumes it
    there, as a staging file's writer does."""

    def __init__(self, consume: Callable[[memoryview], None]) -> None:
        self.consume = consume
        self.buffer = direct_file.take_buffer()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.consume(memoryview(data))

    def space(self) -> memoryview:
        return memoryview(self.buffer)

    def landed(self, nbytes: int) -> None:
        self.consume(memoryview(self.buffer)[:nbytes])

    def give_back(self) -> None:
        direct_file.give_back(self.buffer)


class SocketHash:
    """Answers each request with the SHA-256 and length of its body and whether it came from the socket.

    ``fail_after``: raise from the consumer once this many bytes came (the app's own error).
    ``spaces``: receive into a :class:`Spaces` of these sizes rather than a :class:`Pooled` buffer.
    Errors the app saw are kept in ``errors``; ``blocking`` tells, for each body read from the
    socket, whether the connection's socket was left blocking (the event loop's must not be).
    """

    def __init__(self, fail_after: int | None = None, spaces: list[int] | None = None, dwell: float = 0.0) -> None:
        self.fail_after = fail_after
        self.spaces, self.dwell = spaces, dwell
        self.errors: list[BaseException] = []
        self.blocking: list[bool] = []
        self.done = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        digest, count = hashlib.sha256(), [0]
        body = offered(scope)
        try:
            if body is not None:

                def consume(view: memoryview) -> None:
                    digest.update(view)
                    count[0] += view.nbytes
                    if self.fail_after is not None and count[0] >= self.fail_after:
                        raise InvalidInputError("the app refuses this body")

                pooled = Pooled(consume)
                try:
                    await body.read_into(Spaces(self.spaces, consume, self.dwell) if self.spaces else pooled)
                finally:
                    pooled.give_back()
                    self.blocking.append(os.get_blocking(body._fd))
            else:
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise InvalidInputError("disconnected")
                    digest.update(message["body"])
                    count[0] += len(message["body"])
                    more = message["more_body"]
        except CheckpointError as error:
            self.errors.append(error)
            answer, status = json.dumps({"code": error.code}).encode(), error.http_status
        else:
            answer = json.dumps({"sha256": digest.hexdigest(), "bytes": count[0], "socket": body is not None}).encode()
            status = 200
        finally:
            self.done.set()
        headers = [(b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """Serve a SocketHash with the project's protocol, set up as ``ckptstore serve`` does for
    settings given to the call (timeouts); yields a function that starts one and returns the
    server's address."""
    stack: list[Any] = []

    def start(app: SocketHash, **given: Any) -> tuple[str, int]:
        context = running_server(app, Settings(home=tmp_path / "home", **given))  # type: ignore[arg-type]
        url = context.__enter__()
        stack.append(context)
        host, port = url.removeprefix("http://").split(":")
        return host, int(port)

    yield start
    for context in reversed(stack):
        context.__exit__(None, None, None)


def head(length: int, extra: str = "") -> bytes:
    return f"PUT /x HTTP/1.1\r\nHost: t\r\nContent-Length: {length}\r\n{extra}\r\n".encode()


def response(sock: socket.socket) -> tuple[int, dict[str, Any], bytes]:
    """Status, JSON body and the header block of one response; then whatever follows until close."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    header, _, rest = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(header.split()[1]), json.loads(rest[:length]), header.lower()


def closed(sock: socket.socket) -> bool:
    """Whether the server closes the connection (reads until it does, or a timeout says it will not)."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), extra=st.integers(0, 3 * BUFFER_BYTES))
def test_a_large_body_sent_in_random_pieces_comes_from_the_socket_whole_and_in_order(
    serve: Any, seed: int, extra: int
) -> None:
    rng = random.Random(seed)
    body = rng.randbytes(MIN_BODY_BYTES + extra)
    address = serve(SocketHash())
    with socket.create_connection(address, timeout=30) as sock:
        data, at = head(len(body)) + body, 0
        while at < len(data):  # the first piece may carry the headers and part of the body
            step = rng.choice([1, 7, 1000, 65536, 1 << 20, 3 << 20])
            sock.sendall(data[at : at + step])
            at += step
        status, answer, header = response(sock)
        assert status == 200
        assert answer == {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body), "socket": True}
        assert b"connection: close" in header and closed(sock)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    spaces=st.lists(st.one_of(st.integers(1, 9000), st.integers(1, 2 * BUFFER_BYTES)), min_size=1, max_size=8),
)
def test_a_body_received_into_spaces_of_any_size_lands_whole_and_in_order(
    serve: Any, seed: int, spaces: list[int]
) -> None:
    rng = random.Random(seed)
    body = rng.randbytes(MIN_BODY_BYTES + rng.randrange(BUFFER_BYTES))
    app = SocketHash(spaces=spaces)
    address = serve(app)
    with socket.create_connection(address, timeout=30) as sock:
        data, at = head(len(body)) + body, 0
        while at < len(data):
            step = rng.choice([1000, 65536, 1 << 20, 3 << 20])
            sock.sendall(data[at : at + step])
            at += step
        status, answer, _ = response(sock)
    assert status == 200
    assert answer == {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body), "socket": True}
    assert app.blocking == [False]


def test_time_spent_on_what_landed_does_not_count_against_the_body_rate(serve: Any) -> None:
    app = SocketHash(spaces=[1 << 20], dwell=1.0)  # one piece's work outlasts the whole window
    address = serve(app, body_timeout=0.5, min_body_rate=4 << 20)  # 2 MiB a window: more than had come
    body = os.urandom(BIG)
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(head(len(body)) + body)
        status, answer, _ = response(sock)
    assert status == 200 and answer["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_slow_last_piece_is_taken_as_it_comes_not_at_the_end_of_the_window(serve: Any) -> None:
    # The tail is fewer bytes than the receive low-water mark: on a kernel that wakes a reader
    # only once the mark's bytes wait, a mark left up would keep it waiting out the 20 s window.
    app = SocketHash()
    address = serve(app, body_timeout=20.0, min_body_rate=1000)
    body = os.urandom(MIN_BODY_BYTES + 2 * LOW_WATER + 100)
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(head(len(body)) + body[:-100])
        threading.Event().wait(0.3)  # a client whose last bytes come late
        started = time.monotonic()
        sock.sendall(body[-100:])
        status, answer, _ = response(sock)
        assert time.monotonic() - started < 10
    assert status == 200 and answer["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_small_body_goes_through_receive_and_the_connection_stays_open(serve: Any) -> None:
    body = os.urandom(MIN_BODY_BYTES - 1)
    address = serve(SocketHash())
    with socket.create_connection(address, timeout=30) as sock:
        for _ in range(2):
            sock.sendall(head(len(body)) + body)
            status, answer, _ = response(sock)
            assert status == 200 and answer["socket"] is False and answer["bytes"] == len(body)


def test_a_chunked_body_is_not_offered(serve: Any) -> None:
    body = os.urandom(MIN_BODY_BYTES + 1)
    address = serve(SocketHash())
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(b"PUT /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.sendall(b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        status, answer, _ = response(sock)
    assert status == 200 and answer["socket"] is False and answer["sha256"] == hashlib.sha256(body).hexdigest()


def test_expect_100_continue_is_answered_before_the_body_is_read(serve: Any) -> None:
    body = os.urandom(BIG)
    address = serve(SocketHash())
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(head(len(body), "Expect: 100-continue\r\n"))
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(1)
        assert interim.startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        status, answer, _ = response(sock)
    assert status == 200 and answer["socket"] is True and answer["sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_body_cut_off_by_the_client_is_an_error_naming_what_came(serve: Any, reset: bool) -> None:
    app = SocketHash()
    address = serve(app)
    sent = MIN_BODY_BYTES + 1000
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(head(BIG) + os.urandom(sent))
        if reset:  # closed with a reset, which may drop what the server had not read yet
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            sock.shutdown(socket.SHUT_WR)
            assert app.done.wait(30)
    assert app.done.wait(30)
    assert len(app.errors) == 1 and isinstance(app.errors[0], InvalidInputError)
    assert ("cut off after" if reset else f"cut off after {sent} bytes") in str(app.errors[0])


def test_an_error_of_the_consumer_stops_the_read_and_is_answered(serve: Any) -> None:
    app = SocketHash(fail_after=BUFFER_BYTES)
    address = serve(app)
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(head(BIG) + os.urandom(2 * BUFFER_BYTES))  # the rest never comes
        status, answer, _ = response(sock)
        assert status == 400 and answer == {"code": "invalid_input"}
        assert closed(sock)


def test_a_refused_body_trickled_on_does_not_hold_back_the_answer(serve: Any) -> None:
    app = SocketHash(fail_after=BUFFER_BYTES)
    address = serve(app)
    answered = threading.Event()
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(head(BIG) + os.urandom(2 * BUFFER_BYTES))

        def trickle() -> None:  # a byte now and then, each sooner than the server waits for one
            while not answered.wait(socket_body.DISCARD_WAIT / 4):
                try:
                    sock.send(b"x")
                except OSError:
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            status, answer, _ = response(sock)
        finally:
            answered.set()
            sender.join()
    assert status == 400 and answer == {"code": "invalid_input"}


def test_a_body_that_stalls_is_dropped_after_its_window(serve: Any) -> None:
    app = SocketHash()
    address = serve(app, body_timeout=0.5, min_body_rate=1000)
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(head(BIG) + os.urandom(MIN_BODY_BYTES))  # then nothing more
        status, answer, _ = response(sock)
    assert status == 408 and answer == {"code": "request_timeout"}
    assert isinstance(app.errors[0], RequestTimeoutError) and "1000 bytes a second" in str(app.errors[0])


def test_a_rate_window_counts_only_reading_time() -> None:
    window = RateWindow(0.2, 10)
    window.pause()
    left_paused = window.left()
    ended = threading.Event()
    ended.wait(0.3)  # longer than the window, all of it paused
    window.resume()
    assert window.left() > 0.1 and left_paused > 0.1
    window.check(0)  # the window has not ended: nothing to judge
    ended.wait(window.left() + 0.01)
    with pytest.raises(RequestTimeoutError, match="brought 0 bytes"):
        window.check(0)
    window = RateWindow(0.05, 10)
    window.add(1)
    ended.wait(0.06)
    window.check(1)  # one byte in 0.05 s is the least rate's 0.5: a new window starts
    assert window.left() > 0.02


def test_bodies_are_read_into_the_pooled_buffers_a_starting_server_warms(serve: Any) -> None:
    direct_file._idle_buffers.clear()
    direct_file.warm_buffers(1 + 6)  # the app's landing buffer and a staging file's buffers
    pooled = {id(buffer) for buffer in direct_file._idle_buffers}
    assert len(pooled) == 1 + 6
    address = serve(SocketHash())
    for _ in range(2):
        body = os.urandom(BIG)
        with socket.create_connection(address, timeout=30) as sock:
            sock.sendall(head(len(body)) + body)
            status, answer, _ = response(sock)
        assert status == 200 and answer["sha256"] == hashlib.sha256(body).hexdigest()
    assert {id(buffer) for buffer in direct_file._idle_buffers} == pooled  # the same buffers, back after each body
    direct_file.warm_buffers(10 * direct_file.MAX_IDLE_BUFFERS)
    assert len(direct_file._idle_buffers) == direct_file.MAX_IDLE_BUFFERS
