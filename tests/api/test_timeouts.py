"""Read timeouts, the connection cap and uvicorn's own errors, over raw sockets to a real server.

The server is the app on PostgreSQL served by uvicorn exactly as ``ckptstore serve`` sets it up
(:func:`service.api.server.server_config`), with timeouts of a second so the tests are quick.
Clients trickle headers or bodies a byte at a time, open connections and send nothing, or hold
hundreds of half-sent requests without a token: each is dropped once its timeout passes, while
another client keeps being served. Nothing here waits on a timer to synchronise: a trickling
client sends its next byte when the server has not answered within a short poll.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from ckptstore.service.api.app import create_app
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from tests.api.kit import TOKENS, bearer
from tests.servers import running_server

TIMEOUT = 1.0
MIN_RATE = 1000
#: How long past its timeout a connection may take to be dropped (a loaded machine is slow).
SLACK = 4.0
#: How long a trickling client waits for an answer before it sends its next byte.
STEP = 0.2


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """Timeouts of a second and a generous connection cap (a test may lower it)."""
    return {"max_connections": 512}


@pytest.fixture
def address(pg_url: str, tmp_path: Path, settings_overrides: dict[str, Any]) -> Iterator[tuple[str, int]]:
    """The server's host and port."""
    timeouts = {"header_timeout": TIMEOUT, "body_timeout": TIMEOUT, "keep_alive_timeout": TIMEOUT}
    settings = Settings(
        home=tmp_path / "home",
        database_url=pg_url,
        tokens=TOKENS,
        min_body_rate=MIN_RATE,
        **{**timeouts, **settings_overrides},
    )
    store = open_store(settings)
    try:
        with running_server(create_app(store, settings), settings) as url:
            parts = urlsplit(url)
            yield parts.hostname or "", parts.port or 0
    finally:
        store.close()


def connect(address: tuple[str, int]) -> socket.socket:
    """A connection to the server."""
    return socket.create_connection(address, timeout=30)


def answer_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sends within ``seconds`` until it closes: None if it sends nothing and
    keeps the connection open that long, else everything it sent (``b""`` for a bare close)."""
    deadline = time.monotonic() + seconds
    received = b""
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return received or None


def read_response(sock: socket.socket) -> bytes:
    """One whole response (its Content-Length tells where it ends); the connection stays open."""
    received = b""
    while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < _length(received):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {received!r}"
        received += chunk
    return received


def _length(received: bytes) -> int:
    head = received.partition(b"\r\n\r\n")[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def trickle(sock: socket.socket, data: bytes) -> tuple[bytes, float]:
    """Send ``data`` a byte per :data:`STEP` until the server answers or closes; what it sent
    and how long after the first byte."""
    started = time.monotonic()
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        answer = answer_within(sock, STEP)
        if answer is not None:
            return answer, time.monotonic() - started
    answer = answer_within(sock, TIMEOUT + SLACK)
    return (answer if answer is not None else b"<still open>"), time.monotonic() - started


def json_error(answer: bytes, status: int) -> dict[str, Any]:
    """The JSON error body of a raw response, checking its status and X-Error-Code."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), answer[:400]
    error = json.loads(body)
    assert set(error) == {"code", "message"}, error
    assert f"x-error-code: {error['code']}".encode() in head.lower(), head
    return error


def healthy(address: tuple[str, int]) -> bool:
    """Another client's /healthz, on a connection of its own, answers 200."""
    with httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=10) as http:
        return http.get("/healthz").status_code == 200


def test_headers_trickled_a_byte_at_a_time_are_dropped_while_others_are_served(address: tuple[str, int]) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + b"X-Padding: " + b"p" * 40 + b"\r\n\r\n"
    with connect(address) as sock:
        connected = time.monotonic()
        served_meanwhile = healthy(address)
        answer, _ = trickle(sock, request)
        took = time.monotonic() - connected
    assert served_meanwhile
    error = json_error(answer, 408)
    assert error["code"] == "request_timeout" and "headers" in error["message"]
    # The server's clock starts when it accepts, after connect() returned here.
    assert TIMEOUT - 0.05 <= took <= TIMEOUT + SLACK, took
    assert healthy(address)


def test_a_body_trickled_a_byte_at_a_time_is_dropped(address: tuple[str, int]) -> None:
    body = json.dumps({"digests": []}).encode().ljust(100)
    head = (
        f"POST /v1/tensors/missing HTTP/1.1\r\nHost: t\r\nAuthorization: {bearer('write')['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with connect(address) as sock:
        sock.sendall(head)
        answer, took = trickle(sock, body)
        assert healthy(address)
    error = json_error(answer, 408)
    assert error["code"] == "request_timeout" and f"{MIN_RATE} bytes a second" in error["message"]
    assert took <= 2 * TIMEOUT + SLACK, took


def test_a_body_sent_at_speed_is_not_cut(address: tuple[str, int]) -> None:
    """The body timer judges slow senders only: a body that keeps coming is read whole."""
    body = json.dumps({"digests": [f"{n:064x}" for n in range(50_000)]}).encode()
    with httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=60) as http:
        response = http.post(
            "/v1/tensors/missing", content=body, headers={**bearer("write"), "Content-Type": "application/json"}
        )
    assert response.status_code == 200 and len(response.json()["missing"]) == 50_000


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(address: tuple[str, int]) -> None:
    with connect(address) as sock:
        started = time.monotonic()
        answer = answer_within(sock, TIMEOUT + SLACK)
        took = time.monotonic() - started
    assert answer == b"", answer
    assert TIMEOUT - 0.2 <= took <= TIMEOUT + SLACK, took


def test_an_idle_kept_alive_connection_is_closed(address: tuple[str, int]) -> None:
    with connect(address) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert answer_within(sock, TIMEOUT + SLACK) == b""
    assert time.monotonic() - started <= TIMEOUT + SLACK


def test_hundreds_of_half_sent_requests_without_a_token_are_all_dropped(address: tuple[str, int]) -> None:
    half = b"POST /v1/tensors/missing HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    socks = [connect(address) for _ in range(300)]
    try:
        for sock in socks:
            sock.sendall(half)
        assert healthy(address)  # while all 300 are open
        deadline = time.monotonic() + TIMEOUT + SLACK + 5
        open_ = set(socks)
        while open_ and time.monotonic() < deadline:
            readable, _, _ = select.select(list(open_), [], [], deadline - time.monotonic())
            for sock in readable:
                try:
                    while sock.recv(65536):
                        pass
                except (ConnectionResetError, BlockingIOError):
                    pass
                open_.discard(sock)
        assert not open_, f"{len(open_)} of 300 half-sent requests are still open"
    finally:
        for sock in socks:
            sock.close()
    assert healthy(address)


@pytest.mark.parametrize(
    "settings_overrides", [{"max_connections": 5, "header_timeout": 60.0, "keep_alive_timeout": 60.0}]
)
def test_past_the_connection_cap_a_request_is_503_while_an_existing_client_is_served(
    address: tuple[str, int],
) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
    with connect(address) as kept:
        kept.sendall(request)
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        holders = [connect(address) for _ in range(4)]  # with `kept`, the cap of 5
        try:
            for sock in holders:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")  # never finished
            with connect(address) as extra:
                extra.sendall(request)
                refused = answer_within(extra, 10)
            assert refused is not None
            error = json_error(refused, 503)
            assert error["code"] == "unavailable" and b"retry-after: 1" in refused.lower()
            kept.sendall(request)  # the client already connected is still served
            assert read_response(kept).startswith(b"HTTP/1.1 200")
        finally:
            for sock in holders:
                sock.close()
        # With the holders gone, new clients are served again; the server notices the closes
        # on its own, so ask until it has (bounded).
        deadline = time.monotonic() + 10
        while not healthy(address):
            assert time.monotonic() < deadline


GARBAGE = {
    "not http": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
    "bad method": b"G\x00T / HTTP/1.1\r\nHost: t\r\n\r\n",
    "bad version": b"GET / HTTP/9.9\r\nHost: t\r\n\r\n",
    "space in a header name": b"GET / HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n",
    "bad content-length": b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: -5\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", list(GARBAGE.values()), ids=list(GARBAGE))
def test_a_request_the_http_parser_refuses_is_a_json_400(address: tuple[str, int], request_bytes: bytes) -> None:
    with connect(address) as sock:
        sock.sendall(request_bytes)
        answer = answer_within(sock, 10)
    assert answer is not None
    error = json_error(answer, 400)
    assert error["code"] == "invalid_input" and "malformed HTTP request" in error["message"]
    assert b"connection: close" in answer.lower()


def test_the_default_timeouts_drop_a_byte_a_second_sender_within_a_minute() -> None:
    """A byte a second breaks the header deadline, and the body rate over the first window."""
    defaults = Settings()
    assert defaults.header_timeout <= 60
    assert defaults.body_timeout <= 60 and defaults.min_body_rate > 1
    assert defaults.max_connections < 10_000 and defaults.keep_alive_timeout <= 60
