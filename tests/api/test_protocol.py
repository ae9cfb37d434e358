"""The uvicorn protocol that hands request bodies over piece by piece (service.api.http.protocol).

Two kinds of test. Over a real uvicorn on loopback, raw sockets send bodies in awkward pieces,
with ``Expect: 100-continue``, pipelined, or cut off, and a plain ASGI app reports what it
received. Driven directly, the protocol is fed bytes synchronously, the way its transport
does, so the tests can assert exactly which messages the app gets and when the socket is
paused, without depending on timing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

from ckptstore.service.api.http.protocol import BodyPieces, PiecewiseBodyProtocol, PiecewiseRequestCycle
from ckptstore.service.api.server import BODY_BUFFER_BYTES, http_protocol, tune_uvicorn
from tests.servers import running_server

Message = dict[str, Any]


class BodyEcho:
    """An ASGI app answering every request with the SHA-256 of its body and the messages it took."""

    def __init__(self) -> None:
        self.disconnected = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        digest, sizes, more = hashlib.sha256(), [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return
            assert type(message["body"]) is bytes
            digest.update(message["body"])
            sizes.append(len(message["body"]))
            more = message["more_body"]
        answer = json.dumps({"sha256": digest.hexdigest(), "bytes": sum(sizes), "messages": len(sizes)}).encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]}
        )
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture
def echo() -> Iterator[tuple[BodyEcho, tuple[str, int]]]:
    """A BodyEcho served by uvicorn with the project's protocol; yields it and its address."""
    app = BodyEcho()
    with running_server(app) as url:  # type: ignore[arg-type]
        host, port = url.removeprefix("http://").split(":")
        yield app, (host, int(port))


def post_head(length: int, extra: str = "") -> bytes:
    return f"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: {length}\r\n{extra}\r\n".encode()


def read_response(sock: socket.socket, buffered: bytearray) -> tuple[int, dict[str, Any]]:
    """One response (status, JSON body) from ``sock``; bytes past it stay in ``buffered``."""
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buffered += chunk
    head, _, _ = bytes(buffered).partition(b"\r\n\r\n")
    status = int(head.split()[1])
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    end = len(head) + 4 + length
    while len(buffered) < end:
        buffered += sock.recv(65536)
    body = bytes(buffered[len(head) + 4 : end])
    del buffered[:end]
    return status, json.loads(body)


def test_the_served_protocol_is_the_piecewise_one() -> None:
    assert http_protocol() == "ckptstore.service.api.http.protocol:PiecewiseBodyProtocol"
    config = uvicorn.Config(BodyEcho(), http=http_protocol())
    config.load()
    assert config.http_protocol_class is PiecewiseBodyProtocol


@pytest.mark.parametrize("seed", range(4))
def test_a_body_sent_in_random_pieces_arrives_whole_and_in_order(
    echo: tuple[BodyEcho, tuple[str, int]], seed: int
) -> None:
    rng = random.Random(seed)
    body = rng.randbytes(rng.choice([1, 1000, 3 << 20, 9 << 20]))
    wire = post_head(len(body)) + body
    with socket.create_connection(echo[1]) as sock:
        cut = 0
        while cut < len(wire):
            step = rng.choice([1, 7, 4096, 65536, 1 << 20])
            sock.sendall(wire[cut : cut + step])
            cut += step
        status, answer = read_response(sock, bytearray())
    assert status == 200
    assert answer["sha256"] == hashlib.sha256(body).hexdigest() and answer["bytes"] == len(body)


def test_requests_without_a_body_get_one_empty_final_message(echo: tuple[BodyEcho, tuple[str, int]]) -> None:
    with socket.create_connection(echo[1]) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
        status, answer = read_response(sock, bytearray())
    assert (status, answer["bytes"], answer["messages"]) == (200, 0, 1)


def test_pipelined_requests_on_one_connection_are_answered_in_order(echo: tuple[BodyEcho, tuple[str, int]]) -> None:
    bodies = [b"a" * 10, random.Random(1).randbytes(2 << 20), b"", b"z"]
    with socket.create_connection(echo[1]) as sock:
        sock.sendall(b"".join(post_head(len(body)) + body for body in bodies))
        buffered = bytearray()
        answers = [read_response(sock, buffered) for _ in bodies]
    assert [a["sha256"] for _, a in answers] == [hashlib.sha256(body).hexdigest() for body in bodies]


def test_expect_100_continue_is_answered_before_the_body_is_sent(echo: tuple[BodyEcho, tuple[str, int]]) -> None:
    body = b"x" * 100_000
    with socket.create_connection(echo[1]) as sock:
        sock.sendall(post_head(len(body), "Expect: 100-continue\r\n"))
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        status, answer = read_response(sock, bytearray())
    assert (status, answer["bytes"]) == (200, len(body))


def test_a_body_cut_off_by_the_client_ends_in_a_disconnect(echo: tuple[BodyEcho, tuple[str, int]]) -> None:
    app, address = echo
    with socket.create_connection(address) as sock:
        sock.sendall(post_head(10 << 20) + b"y" * (3 << 20))
    assert app.disconnected.wait(timeout=30)


# --------------------------------------------------------------------------------------
# Driven directly: what the app receives, message by message
# --------------------------------------------------------------------------------------


class Recorder:
    """An ASGI app that hands every message it receives to the test, one per request of the test."""

    def __init__(self) -> None:
        self.receive: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.receive = receive
        self.done = asyncio.get_running_loop().create_future()
        await self.done  # the test drives receive() itself, then answers
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def driven() -> Iterator[tuple[asyncio.AbstractEventLoop, PiecewiseBodyProtocol, Recorder, socket.socket]]:
    """The protocol on a real transport (a socket pair), fed by the test through data_received."""
    tune_uvicorn()
    loop = asyncio.new_event_loop()
    app = Recorder()
    config = uvicorn.Config(app, http=PiecewiseBodyProtocol, lifespan="off", log_level="warning")
    config.load()
    protocol = PiecewiseBodyProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    ours, peer = socket.socketpair()

    async def connect() -> None:
        await loop.connect_accepted_socket(lambda: protocol, ours)

    loop.run_until_complete(connect())
    try:
        yield loop, protocol, app, peer
    finally:
        protocol.connection_lost(None)
        loop.run_until_complete(asyncio.sleep(0))  # let the cancelled task finish
        loop.close()
        peer.close()


def start(loop: asyncio.AbstractEventLoop, protocol: PiecewiseBodyProtocol, app: Recorder, head: bytes) -> None:
    protocol.data_received(head)
    while app.receive is None:  # the app task starts on the loop's next turn
        loop.run_until_complete(asyncio.sleep(0))


def test_queued_pieces_reach_the_app_one_per_message_without_being_joined(driven: Any) -> None:
    loop, protocol, app, _ = driven
    pieces = [bytes([n]) * size for n, size in enumerate([5, 70_000, 1, 300_000])]
    start(loop, protocol, app, post_head(sum(map(len, pieces))))
    for piece in pieces:  # all of it arrives before the app asks for any
        protocol.data_received(piece)
    assert isinstance(protocol.cycle, PiecewiseRequestCycle)
    messages = [loop.run_until_complete(app.receive()) for _ in pieces]
    assert [m["body"] for m in messages] == pieces  # stock uvicorn hands over one joined copy
    assert [m["more_body"] for m in messages] == [True, True, True, False]
    app.done.set_result(None)


def test_the_socket_pauses_past_the_high_water_mark_and_resumes_as_the_app_catches_up(driven: Any) -> None:
    loop, protocol, app, _ = driven
    assert httptools_impl.HIGH_WATER_LIMIT == BODY_BUFFER_BYTES
    piece = b"p" * (256 << 10)
    count = BODY_BUFFER_BYTES // len(piece) + 4
    start(loop, protocol, app, post_head(count * len(piece)))
    for _ in range(count):
        protocol.data_received(piece)
    assert protocol.flow.read_paused
    taken = 0
    while protocol.flow.read_paused:
        assert loop.run_until_complete(app.receive())["body"] == piece
        taken += 1
    # reading resumes once no more than half the high-water mark is still queued
    assert (count - taken) * len(piece) <= BODY_BUFFER_BYTES // 2 < (count - taken + 1) * len(piece)
    app.done.set_result(None)


def test_a_disconnect_while_pieces_are_queued_is_reported_at_once(driven: Any) -> None:
    loop, protocol, app, _ = driven
    start(loop, protocol, app, post_head(1000))
    protocol.data_received(b"q" * 10)
    protocol.connection_lost(None)
    assert loop.run_until_complete(app.receive()) == {"type": "http.disconnect"}
    app.done.set_result(None)


def test_body_pieces_count_what_is_queued() -> None:
    pieces = BodyPieces()
    assert not pieces and pieces.take() == b""
    pieces += b"ab"
    pieces += b"cde"
    assert len(pieces) == 5
    assert (pieces.take(), len(pieces), pieces.take(), len(pieces)) == (b"ab", 3, b"cde", 0)
