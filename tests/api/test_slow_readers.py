"""Clients that stop reading their answers, over raw sockets to ``ckptstore serve`` in a process
of its own (whose memory the test reads from ``/proc``).

Each stalled client sends a whole, valid request for a large answer (``GET /v1/shards/{id}``
or ``POST /v1/shards/ranges``) with a read token and never reads a byte. The server must drop
it once the write timeout passes, seen here as a reset that ``poll`` reports on the socket
itself (``POLLRDHUP``) without reading; hold at most its memory budget for a hundred of them;
and still answer ``/healthz`` at once. A client that reads slowly, but takes every piece within
the timeout, gets every byte. Nothing waits on a timer to synchronise: the tests wait on the
sockets, or ask the server's ``/metrics`` until it reports what they wait for.
"""

from __future__ import annotations

import json
import re
import select
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from ckptstore.service.api.http.streaming import PIECE_BYTES
from tests.api.kit import TOKENS, Shard, bearer, build_shard, tensor
from tests.api.served_process import ServedProcess, serve_process

#: The write timeout of the servers here, and how long past it a connection may take to be
#: dropped on a loaded machine.
TIMEOUT = 2.0
SLACK = 4.0
#: The servers' memory budget for answers not yet taken (the default is 256 MiB).
BUDGET = 64 << 20
SHARD_BYTES = 16 << 20
READ = bearer("read")["Authorization"]


@dataclass
class Server:
    """A running ``ckptstore serve`` holding ``shard``."""

    process: ServedProcess
    shard: Shard

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.process.url)
        return parts.hostname or "", parts.port or 0

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.process.url, timeout=60, headers=bearer("read"))

    def unsent_bytes(self) -> int:
        """The server's ``ckptstore_unsent_bytes`` gauge."""
        with self.http() as http:
            text = http.get("/metrics").text
        return int(next(line for line in text.splitlines() if line.startswith("ckptstore_unsent_bytes ")).split()[1])

    def wait_for_unsent_bytes(self, done: Callable[[int], bool], seconds: float) -> int:
        """Ask the gauge until ``done(value)``; the last value (the caller asserts on it)."""
        deadline = time.monotonic() + seconds
        while not done(value := self.unsent_bytes()) and time.monotonic() < deadline:
            pass
        return value


@pytest.fixture(scope="module")
def shard() -> Shard:
    """One shard of 16 MiB of random bytes."""
    return build_shard(tensor(7, "U8", (SHARD_BYTES,)))


@pytest.fixture
def serve(tmp_path: Path, shard: Shard) -> Iterator[Callable[..., Server]]:
    """Start ``ckptstore serve`` with the test tokens, ``BUDGET`` and the given settings, holding ``shard``."""
    with ExitStack() as stack:

        def start(**settings: str) -> Server:
            home = tmp_path / f"home-{time.monotonic_ns()}"
            options = {"tokens": TOKENS, "max_unsent_bytes": str(BUDGET), **settings}
            process = stack.enter_context(serve_process(home, **options))
            with httpx.Client(base_url=process.url, timeout=60, headers=bearer("write")) as http:
                assert http.put(f"/v1/shards/{shard.shard_id}", content=shard.data).status_code == 201
            return Server(process, shard)

        yield start


def get_shard(shard: Shard) -> tuple[bytes, int]:
    """A raw ``GET`` of the whole shard, and the size of its body."""
    head = f"GET /v1/shards/{shard.shard_id} HTTP/1.1\r\nHost: t\r\nAuthorization: {READ}\r\n\r\n"
    return head.encode(), len(shard.data)


def post_ranges(spans: list[tuple[Shard, int, int]]) -> tuple[bytes, int]:
    """A raw ``POST /v1/shards/ranges`` of ``(shard, offset, length)`` spans, and the size of its body."""
    body = json.dumps(
        {"ranges": [{"shard_id": s.shard_id, "offset": offset, "length": length} for s, offset, length in spans]}
    ).encode()
    head = (
        f"POST /v1/shards/ranges HTTP/1.1\r\nHost: t\r\nAuthorization: {READ}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body, sum(length for _, _, length in spans)


def whole_shards(shard: Shard, total: int) -> tuple[bytes, int]:
    """A batch asking for the whole shard again and again, ``total`` bytes in all."""
    return post_ranges([(shard, 0, len(shard.data))] * (total // len(shard.data)))


def stalled(address: tuple[str, int], request: bytes) -> socket.socket:
    """A connection that has sent ``request`` and will not read the answer."""
    sock = socket.create_connection(address, timeout=30)
    sock.sendall(request)
    return sock


def closed_by_server(socks: list[socket.socket], seconds: float) -> dict[socket.socket, float]:
    """When (``time.monotonic()``) the server closed or reset each of ``socks``, waiting at most
    ``seconds``: ``poll`` reports a peer's close (POLLRDHUP) or reset whatever unread data is
    queued. Sockets still open at the end are left out."""
    poller = select.poll()
    waiting = {sock.fileno(): sock for sock in socks}
    for fd in waiting:
        poller.register(fd, select.POLLRDHUP)
    closed: dict[socket.socket, float] = {}
    deadline = time.monotonic() + seconds
    while waiting and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            closed[waiting.pop(fd)] = time.monotonic()
    return closed


def read_to_end(sock: socket.socket, seconds: float = 30) -> tuple[int, str]:
    """Read what the server sent until it closed: how many bytes, and ``"eof"`` or ``"reset"``
    (``"open"`` if it still sends after ``seconds``)."""
    received, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            break
        try:
            chunk = sock.recv(1 << 20)
        except ConnectionResetError:
            return received, "reset"
        if not chunk:
            return received, "eof"
        received += len(chunk)
    return received, "open"


def read_in_full(server: Server, request: bytes, size: int) -> None:
    """Send ``request`` (raw, as :func:`stalled` does) on a new connection and read its whole answer."""
    with socket.create_connection(server.address, timeout=60) as sock:
        sock.sendall(request)
        head = bytearray()
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, "the connection closed before the answer's head came"
            head += chunk
        got = len(head.partition(b"\r\n\r\n")[2])
        while got < size:
            chunk = sock.recv(1 << 20)
            assert chunk, f"the connection closed after {got} of {size} bytes"
            got += len(chunk)
    assert head.startswith(b"HTTP/1.1 200"), bytes(head[:200])


def healthz_ms(server: Server, count: int) -> list[float]:
    """``count`` timings of /healthz, each on a new connection (as a load balancer's probe)."""
    timings = []
    for _ in range(count):
        with httpx.Client(base_url=server.process.url, timeout=30) as http:
            started = time.perf_counter()
            assert http.get("/healthz").status_code == 200
            timings.append((time.perf_counter() - started) * 1000)
    return timings


def test_clients_that_never_read_are_dropped_once_the_write_timeout_passes(serve: Callable[..., Server]) -> None:
    server = serve(write_timeout=str(TIMEOUT))
    shard = server.shard
    requests = [get_shard(shard), whole_shards(shard, 64 << 20)] * 10
    socks, sent = [], []
    try:
        for request, _ in requests:
            socks.append(stalled(server.address, request))
            sent.append(time.monotonic())
        closed = closed_by_server(socks, TIMEOUT + SLACK + (sent[-1] - sent[0]))
        assert len(closed) == len(socks), f"{len(socks) - len(closed)} of {len(socks)} stalled clients are still open"
        for sock, asked in zip(socks, sent, strict=True):
            # The clock starts with the answer, after the request was sent.
            assert TIMEOUT - 0.05 <= closed[sock] - asked <= TIMEOUT + SLACK, closed[sock] - asked
        for sock, (_, size) in zip(socks, requests, strict=True):
            received, end = read_to_end(sock)
            assert end in ("eof", "reset") and received < size, (received, end)
    finally:
        for sock in socks:
            sock.close()
    assert server.wait_for_unsent_bytes(lambda held: held == 0, 30) == 0  # every piece they held is given back
    with server.http() as http:  # and the server answers as before
        assert http.get(f"/v1/shards/{shard.shard_id}").content == shard.data
    log = server.process.log.read_text()
    assert len(re.findall(r"it did not take the \d+ bytes it was sent within 2 s", log)) == len(socks), log[-2000:]


def test_a_hundred_stalled_clients_hold_at_most_the_budget_and_leave_healthz_fast(
    serve: Callable[..., Server],
) -> None:
    # Answers streamed piece by piece (sendfile off): what they hold is the budget's.
    server = serve(sendfile="false")  # the default write timeout (30 s): the clients stay stalled while measured
    request, size = whole_shards(server.shard, 256 << 20)
    read_in_full(server, request, size)  # warm up: one answer of the same size
    idle = server.process.reset_peak()
    socks = []
    try:
        socks = [stalled(server.address, request) for _ in range(100)]
        # A hundred clients hold a piece or two each, more than the budget: it fills up and stays full.
        held = server.wait_for_unsent_bytes(lambda held: held >= BUDGET - PIECE_BYTES, 60)
        assert BUDGET - PIECE_BYTES <= held <= BUDGET, held
        timings = healthz_ms(server, 9)
        grown = server.process.status_bytes("VmHWM") - idle
        assert statistics.median(timings) < 100, timings
        assert grown < BUDGET + (64 << 20), f"RSS grew by {grown >> 20} MiB over {idle >> 20} MiB idle"
    finally:
        for sock in socks:
            sock.close()
    # Clients that go away give their pieces back.
    assert server.wait_for_unsent_bytes(lambda held: held == 0, 30) == 0


@pytest.mark.parametrize("route", ["GET /v1/shards/{id}", "POST /v1/shards/ranges"])
def test_a_hundred_stalled_clients_of_sendfile_answers_hold_no_memory_nor_threads(
    serve: Callable[..., Server], route: str
) -> None:
    server = serve()  # sendfile (the default for a local folder); the clients stay stalled while measured
    request, size = get_shard(server.shard) if route.startswith("GET") else whole_shards(server.shard, 256 << 20)
    read_in_full(server, request, size)  # warm up: one answer of the same size
    idle = server.process.reset_peak()
    socks = []
    try:
        socks = [stalled(server.address, request) for _ in range(100)]
        for sock in socks:  # every client has its status line: its answer is under way and stuck
            sock.settimeout(30)
            assert sock.recv(12).startswith(b"HTTP/1.1 200")
        # The bytes in flight are the kernel's socket buffers, none read into the server's memory;
        # and no thread waits on a stalled client, so the thread pool still serves /healthz at once.
        assert server.unsent_bytes() == 0
        timings = healthz_ms(server, 9)
        assert statistics.median(timings) < 100, timings
        with server.http() as http:  # a full answer, through the same pool of threads, still comes
            whole = http.get(f"/v1/shards/{server.shard.shard_id}")
            assert whole.status_code == 200 and whole.content == server.shard.data
        grown = server.process.status_bytes("VmHWM") - idle
        assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB over {idle >> 20} MiB idle"
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("route", ["GET /v1/shards/{id}", "POST /v1/shards/ranges"])
def test_a_client_reading_slowly_but_in_time_gets_every_byte(serve: Callable[..., Server], route: str) -> None:
    server = serve(write_timeout=str(TIMEOUT))
    shard = server.shard
    if route.startswith("GET"):
        request, size = get_shard(shard)
        expected = shard.data
    else:
        spans = [(shard, 12_345, 5 << 20), (shard, 3, 1), (shard, len(shard.data) - 5_000_001, 5_000_001)]
        request, size = post_ranges(spans)
        expected = b"".join(shard.data[offset : offset + length] for _, offset, length in spans)
    rate = 3 << 20  # bytes a second: a piece of 1 MiB is taken in a third of a second, well within 2 s
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.settimeout(30)
    received = bytearray()
    with sock:
        sock.connect(server.address)
        sock.sendall(request)
        started = time.monotonic()
        while len(received) < size + 4096 and (chunk := sock.recv(64 << 10)):
            received += chunk
            ahead = len(received) / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)  # pacing the reader, not synchronising with the server
            if b"\r\n\r\n" in received and len(received.partition(b"\r\n\r\n")[2]) == size:
                break
        took = time.monotonic() - started
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert len(body) == size and body == expected
    assert took > TIMEOUT  # the whole answer took longer than the timeout; no piece did
