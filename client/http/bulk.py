"""Shard bytes over HTTP: uploads straight from memory, ranged downloads straight into memory.

The JSON calls go through httpx, but bulk bytes do not: httpx passes every chunk through
several layers of Python buffering (0.4-1.2 GB/s on loopback here). The standard library's
connection hands memoryviews of tensor memory to ``sendall`` and reads responses with
``readinto`` into the destination buffers, so no byte is copied in Python on either side.
Connections are pooled and reused across requests and threads. Measured again against httpx
(:class:`HttpxBulk`) for 256 MiB over loopback: a ranged read took 0.10-0.16 s of client CPU
here and 0.41-0.54 s through httpx, an upload 0.04-0.07 s against 0.10-0.12 s.

They take the same :class:`client.http.route.Route` as httpx: straight to the server, or
through the proxy the environment names (an ``http://`` server's requests in absolute form to
the proxy; an ``https://`` server's through a ``CONNECT`` tunnel). The one route these
connections cannot take, an ``https://`` server through an ``https://`` proxy (TLS inside
TLS), is left to httpx (:func:`carries`). Retries are not decided here: the caller runs every
request under its :class:`client.http.retry.RetryPolicy`.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast
from urllib.parse import urlsplit

import httpx

from ckptstore.client.http.route import Route
from ckptstore.service.errors import IntegrityError
from ckptstore.service.receive_mark import ReceiveMark

#: A pooled connection idle for longer is closed, not reused. A server closes a connection left
#: idle past its keep-alive timeout (uvicorn's and ``ckptstore serve``'s default: 5 s), and a
#: request sent just as it does is lost unanswered: it must be sent again (a retry warning and a
#: pause), and a commit without an ``Idempotency-Key`` cannot be (its outcome is unknown).
#: Dropping connections well before any server's timeout leaves no such moment. Read when a
#: pool is created (the httpx pool of :mod:`client.http.session` too).
IDLE_REUSE_SECONDS = 2.0

if TYPE_CHECKING:
    from ckptstore.client.http.retry import Reply


@dataclass
class BulkResponse:
    """A finished response: status, lower-cased headers, its URL and (for errors and small answers) the body."""

    status_code: int
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes = b""
    url: str = ""

    def close(self) -> None:
        """Nothing to release: the body was read and the connection returned to the pool."""


def still_open(sock: socket.socket | None) -> bool:
    """Whether an idle keep-alive connection's socket may carry another request: it has nothing
    to read. Between requests a server has nothing to say, so a readable socket holds its close
    (or bytes no request asked for): either way the connection is done."""
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return not poller.poll(0)
        return not select.select([sock], [], [], 0)[0]
    except (OSError, ValueError):  # closed here already
        return False


def carries(route: Route) -> bool:
    """Whether these connections can take ``route`` (all but an https server through an https proxy)."""
    return not (route.proxy and route.proxy.startswith("https:") and route.url.startswith("https:"))


class BulkWire(Protocol):
    """Shard bytes to and from one server: :class:`BulkHttp`, or :class:`HttpxBulk` where it cannot go."""

    def put(
        self, path: str, pieces: Sequence[bytes | memoryview], headers: dict[str, str], method: str = "PUT"
    ) -> Reply:
        """PUT (or ``method``) the concatenation of ``pieces``; returns the answer, read."""

    def get_into(self, path: str, headers: dict[str, str], buffers: Sequence[memoryview]) -> Reply:
        """GET ``path``; a 2xx body fills ``buffers`` in order, exactly; any other answer is returned read."""

    def post_into(self, path: str, body: bytes, headers: dict[str, str], buffers: Sequence[memoryview]) -> Reply:
        """POST ``body`` to ``path``; a 2xx answer's body fills ``buffers`` as :meth:`get_into` does."""

    def close(self) -> None:
        """Release the connections."""


class BulkHttp:
    """A small pool of keep-alive connections to one server (or its proxy), for shard bytes only.

    Args:
        route: the server's URL (optionally with a path prefix), its proxy and TLS context;
            one that :func:`carries` accepts.
        headers: sent with every request (authorization, user agent).
        timeout_seconds: socket timeout for connecting and for each read or write.
    """

    def __init__(self, route: Route, headers: dict[str, str], timeout_seconds: float) -> None:
        if not carries(route):
            raise ValueError("an https server through an https proxy needs TLS inside TLS: use HttpxBulk")
        server = urlsplit(route.url)
        https = server.scheme == "https"
        self._base = route.url
        self._server = (server.hostname or "", server.port or (443 if https else 80))
        self._prefix = server.path.rstrip("/")
        self._headers = dict(headers)
        self._timeout = timeout_seconds
        self._context = route.tls
        # Where each TCP connection goes and whether it speaks TLS there; through a proxy, an
        # https server is reached through a CONNECT tunnel, an http one by naming its whole URL.
        self._peer, self._tls = self._server, https
        self._tunnel: dict[str, str] | None = None  # the CONNECT request's headers, when tunnelling
        self._absolute = False
        if route.proxy is not None:
            proxy = urlsplit(route.proxy)
            proxy_tls = proxy.scheme == "https"
            self._peer = (proxy.hostname or "", proxy.port or (443 if proxy_tls else 80))
            authorization = route.proxy_authorization()
            proxy_headers = {"Proxy-Authorization": authorization} if authorization else {}
            if https:
                self._tunnel = proxy_headers
            else:
                self._tls, self._absolute = proxy_tls, True
                self._headers.update(proxy_headers)
        #: Idle connections, each with the monotonic time it last answered.
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._idle_seconds = IDLE_REUSE_SECONDS
        self._lock = threading.Lock()

    def _connection(self) -> http.client.HTTPConnection:
        """A connection idle for at most :data:`IDLE_REUSE_SECONDS` that the server still holds
        open, else a new one (connected on first use).

        A server closes a connection left idle past its keep-alive timeout (uvicorn: 5 s), so a
        training loop that saves every few minutes finds every pooled connection closed: sent on
        one, a request met "Remote end closed connection without response", a retry warning and
        a pause before it was sent again.
        """
        while True:
            with self._lock:
                if not self._idle:
                    break
                idle, since = self._idle.pop()
            if time.monotonic() - since <= self._idle_seconds and still_open(idle.sock):
                return idle
            idle.close()
        host, port = self._peer
        connection: http.client.HTTPConnection
        if self._tls:
            connection = http.client.HTTPSConnection(host, port, timeout=self._timeout, context=self._context)
        else:
            connection = http.client.HTTPConnection(host, port, timeout=self._timeout)
        if self._tunnel is not None:
            connection.set_tunnel(*self._server, headers=self._tunnel)
        return connection

    def _release(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        if response.will_close or not response.isclosed():
            connection.close()
            return
        with self._lock:
            self._idle.append((connection, time.monotonic()))

    def _target(self, path: str) -> str:
        """The request target: the path, or the whole URL when a proxy forwards the request."""
        if not self._absolute:
            return self._prefix + path
        host, port = self._server
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{self._prefix}{path}"

    def _start(self, connection: http.client.HTTPConnection, method: str, path: str, headers: dict[str, str]) -> None:
        connection.putrequest(method, self._target(path), skip_accept_encoding=True)
        for name, value in {**self._headers, **headers}.items():
            connection.putheader(name, value)
        connection.endheaders()
        sock = connection.sock
        if sock is not None and not isinstance(sock, ssl.SSLSocket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(
        self, path: str, pieces: Sequence[bytes | memoryview], headers: dict[str, str], method: str = "PUT"
    ) -> BulkResponse:
        """PUT (or ``method``) the concatenation of ``pieces`` (Content-Length computed here); returns the answer.

        A server that answers before the body is complete (a refused token, an oversized or
        misnamed shard) closes the connection; its answer is still returned when it can be read.
        """
        length = sum(memoryview(piece).nbytes for piece in pieces)
        connection = self._connection()
        try:
            self._start(connection, method, path, {**headers, "Content-Length": str(length)})
            try:
                for piece in pieces:
                    connection.send(memoryview(piece).cast("B"))
            except OSError:
                # The server may have refused the upload and hung up: its answer says why.
                pass
            response = connection.getresponse()
            answer = BulkResponse(response.status, _lower(response.getheaders()), response.read(), self._base + path)
        except BaseException:
            connection.close()
            raise
        self._release(connection, response)
        return answer

    def get_into(self, path: str, headers: dict[str, str], buffers: Sequence[memoryview]) -> BulkResponse:
        """GET ``path`` and, on a 2xx answer, fill ``buffers`` in order with exactly its body.

        On any other status nothing is written and the answer (with its body) is returned.

        Raises:
            IntegrityError: the body is longer or shorter than the buffers.
        """
        return self._into("GET", path, headers, buffers, None)

    def post_into(self, path: str, body: bytes, headers: dict[str, str], buffers: Sequence[memoryview]) -> BulkResponse:
        """POST ``body`` to ``path`` and, on a 2xx answer, fill ``buffers`` as :meth:`get_into` does."""
        return self._into("POST", path, {**headers, "Content-Length": str(len(body))}, buffers, body)

    def _into(
        self, method: str, path: str, headers: dict[str, str], buffers: Sequence[memoryview], body: bytes | None
    ) -> BulkResponse:
        connection = self._connection()
        try:
            self._start(connection, method, path, headers)
            if body:
                connection.send(body)
            response = connection.getresponse()
            answer = BulkResponse(response.status, _lower(response.getheaders()), url=self._base + path)
            if response.status >= 300:
                answer.content = response.read()
            else:
                with _SocketBody.reading(response, connection.sock, self._timeout) as source:
                    fill_buffers(source, buffers, path, response.getheader("content-length"))
        except BaseException:
            connection.close()
            raise
        self._release(connection, response)
        return answer

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection, _ in idle:
            connection.close()


#: How much of a tensor :class:`HttpxBulk` hands httpx at a time.
UPLOAD_SLICE = 1 << 20


class HttpxBulk:
    """Shard bytes through httpx, for the one route :class:`BulkHttp` cannot take (an https
    server through an https proxy). Slower: httpx copies every chunk on its way."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http

    def put(
        self, path: str, pieces: Sequence[bytes | memoryview], headers: dict[str, str], method: str = "PUT"
    ) -> httpx.Response:
        """PUT (or ``method``) the concatenation of ``pieces`` (Content-Length computed here); returns the
        answer, read."""
        views = [memoryview(piece).cast("B") for piece in pieces]
        length = str(sum(view.nbytes for view in views))
        # In slices: httpcore re-slices what a send() leaves over, copying the rest of a whole tensor each time.
        slices = (view[start : start + UPLOAD_SLICE] for view in views for start in range(0, view.nbytes, UPLOAD_SLICE))
        body = cast("Iterator[bytes]", slices)  # h11 takes any bytes-like chunk
        return self._http.request(method, path, content=body, headers={**headers, "Content-Length": length})

    def get_into(self, path: str, headers: dict[str, str], buffers: Sequence[memoryview]) -> httpx.Response:
        """GET ``path`` and, on a 2xx answer, fill ``buffers`` in order with exactly its body.

        Raises:
            IntegrityError: the body is longer or shorter than the buffers.
        """
        return self._into("GET", path, headers, buffers, None)

    def post_into(
        self, path: str, body: bytes, headers: dict[str, str], buffers: Sequence[memoryview]
    ) -> httpx.Response:
        """POST ``body`` to ``path`` and, on a 2xx answer, fill ``buffers`` as :meth:`get_into` does."""
        return self._into("POST", path, headers, buffers, body)

    def _into(
        self, method: str, path: str, headers: dict[str, str], buffers: Sequence[memoryview], body: bytes | None
    ) -> httpx.Response:
        with self._http.stream(method, path, headers=headers, content=body) as response:
            if response.status_code >= 300:
                response.read()
            else:
                fill_buffers(_Chunks(response.iter_raw()), buffers, path, response.headers.get("content-length"))
        return response

    def close(self) -> None:
        """Nothing to release: the httpx client is its owner's to close."""


class _ReadsInto(Protocol):
    def readinto(self, buffer: memoryview) -> int: ...


class _SocketBody:
    """``readinto`` over the rest of a plain-TCP response body of known length, read with
    ``MSG_WAITALL`` straight from the socket once the bytes buffered with the headers are taken.

    ``HTTPResponse.readinto`` returns what one ``recv`` brings (a few dozen KiB over loopback):
    thousands of calls, each through Python and the interpreter lock, for a large range. Here the
    kernel fills each destination buffer in one call (256 MiB over loopback: 0.075 CPU-seconds of
    the client against 0.093). While the body is read (:meth:`reading`) the socket is blocking,
    the kernel's receive timeout standing in for the connection's: a call that brings nothing for
    ``timeout`` seconds raises ``TimeoutError``, as a read of the connection would. Its receive
    low-water mark follows :func:`service.receive_mark.low_water` while the body is read, and is 1
    again after.
    """

    def __init__(self, response: http.client.HTTPResponse, sock: socket.socket, timeout: float) -> None:
        self._response = response
        self._sock = sock
        self._timeout = timeout
        self._buffered = len(response.fp.peek(0)) if response.fp is not None else 0
        self._mark = ReceiveMark(sock)

    @classmethod
    @contextmanager
    def reading(
        cls, response: http.client.HTTPResponse, sock: socket.socket | None, timeout: float
    ) -> Iterator[_ReadsInto]:
        """The fast reader where it applies (plain TCP, a Content-Length), else ``response`` itself;
        the socket is set up for it once, and left as it was found at the end."""
        if sock is None or isinstance(sock, ssl.SSLSocket) or response.chunked or response.length is None:
            yield response
            return
        body = cls(response, sock, timeout)
        seconds = int(timeout)
        sock.settimeout(None)
        try:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
            )
            yield body
        finally:
            body._mark.reset()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
            sock.settimeout(timeout)

    def readinto(self, buffer: memoryview) -> int:
        """Fill as much of ``buffer`` as the body has left (0 at its end)."""
        response = self._response
        left = response.length or 0
        if self._buffered or not left or not buffer.nbytes:
            count = response.readinto(buffer[: self._buffered] if self._buffered else buffer)
            self._buffered -= min(count, self._buffered)
            return count
        want = min(buffer.nbytes, left)
        self._mark.before(left, want)
        try:
            count = self._sock.recv_into(buffer, want, socket.MSG_WAITALL)
        except BlockingIOError:
            raise TimeoutError(f"no bytes came for {self._timeout:g} s") from None
        response.length = left - count
        return count


class _Chunks:
    """``readinto`` over an iterator of chunks."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._left = memoryview(b"")

    def readinto(self, buffer: memoryview) -> int:
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._left = memoryview(chunk)
        count = min(self._left.nbytes, buffer.nbytes)
        buffer[:count] = self._left[:count]
        self._left = self._left[count:]
        return count


def fill_buffers(body: _ReadsInto, buffers: Sequence[memoryview], path: str, declared: str | None) -> None:
    """Fill ``buffers`` in order with exactly the rest of ``body`` (whose Content-Length is ``declared``).

    Raises:
        IntegrityError: the declared length is not the buffers' size, or the body is shorter
            or longer than them.
        http.client.IncompleteRead: the body stopped short of its declared length (cut off in
            transit: a network error, worth a retry).
    """
    expected = sum(buffer.nbytes for buffer in buffers)
    if declared is not None and int(declared) != expected:
        raise IntegrityError(f"the server sent {declared} bytes for {path}, not {expected}")
    for buffer in buffers:
        flat = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        filled = 0
        while filled < flat.nbytes:
            count = body.readinto(flat[filled:])
            if not count:
                if declared is not None:
                    raise http.client.IncompleteRead(b"", flat.nbytes - filled)
                raise IntegrityError(f"the answer for {path} ended after {filled} of {flat.nbytes} bytes")
            filled += count
    if body.readinto(memoryview(bytearray(1))):
        raise IntegrityError(f"the server sent more than {expected} bytes for {path}")


def _lower(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers}
