"""Shard bytes over HTTP: uploads straight from memory, ranged downloads straight into memory.

The JSON calls go through httpx, but bulk bytes do not: httpx passes every chunk through
several layers of Python buffering (0.4-1.2 GB/s on loopback here). The standard library's
connection hands memoryviews of tensor memory to ``sendall`` and reads responses with
``readinto`` into the destination buffers, so no byte is copied in Python on either side.
Connections are pooled and reused across requests and threads.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from service.errors import IntegrityError, InvalidInputError

#: What a broken or refused connection raises here; the transport retries idempotent requests.
BULK_NETWORK_ERRORS = (OSError, http.client.HTTPException)


@dataclass
class BulkResponse:
    """A finished response: status, lower-cased headers and (for errors and small answers) the body."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class BulkHttp:
    """A small pool of keep-alive connections to one server, for shard bytes only.

    Args:
        url: the server's base URL (``http://host:port`` or ``https://…``, optionally with a path prefix).
        headers: sent with every request (authorization, user agent).
        timeout_seconds: socket timeout for connecting and for each read or write.
    """

    def __init__(self, url: str, headers: dict[str, str], timeout_seconds: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInputError(f"not an http(s) URL: {url[:80]!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._headers = dict(headers)
        self._timeout = timeout_seconds
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._context = ssl.create_default_context() if self._https else None

    def _connection(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout, context=self._context)
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def _release(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        if response.will_close or not response.isclosed():
            connection.close()
            return
        with self._lock:
            self._idle.append(connection)

    def _start(self, connection: http.client.HTTPConnection, method: str, path: str, headers: dict[str, str]) -> None:
        connection.putrequest(method, self._prefix + path, skip_accept_encoding=True)
        for name, value in {**self._headers, **headers}.items():
            connection.putheader(name, value)
        connection.endheaders()
        sock = connection.sock
        if sock is not None and not self._https:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, path: str, pieces: Sequence[bytes | memoryview], headers: dict[str, str]) -> BulkResponse:
        """PUT the concatenation of ``pieces`` (Content-Length computed here); returns the answer.

        A server that answers before the body is complete (a refused token, an oversized or
        misnamed shard) closes the connection; its answer is still returned when it can be read.
        """
        length = sum(memoryview(piece).nbytes for piece in pieces)
        connection = self._connection()
        try:
            self._start(connection, "PUT", path, {**headers, "Content-Length": str(length)})
            try:
                for piece in pieces:
                    connection.send(memoryview(piece).cast("B"))
            except OSError:
                # The server may have refused the upload and hung up: its answer says why.
                pass
            response = connection.getresponse()
            answer = BulkResponse(response.status, _lower(response.getheaders()), response.read())
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
        expected = sum(buffer.nbytes for buffer in buffers)
        connection = self._connection()
        try:
            self._start(connection, "GET", path, headers)
            response = connection.getresponse()
            if response.status >= 300:
                answer = BulkResponse(response.status, _lower(response.getheaders()), response.read())
            else:
                declared = response.getheader("content-length")
                if declared is not None and int(declared) != expected:
                    raise IntegrityError(f"the server sent {declared} bytes for {path}, not {expected}")
                for buffer in buffers:
                    flat = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
                    _fill(response, flat, path, declared is not None)
                if response.read(1):
                    raise IntegrityError(f"the server sent more than {expected} bytes for {path}")
                answer = BulkResponse(response.status, _lower(response.getheaders()))
        except BaseException:
            connection.close()
            raise
        self._release(connection, response)
        return answer

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def _fill(response: http.client.HTTPResponse, buffer: memoryview, path: str, declared: bool) -> None:
    """Read exactly ``buffer``'s size of the body into it.

    A body that stops short of its declared Content-Length was cut off in transit (a network
    error, worth a retry); one without a declared length that ends early is simply short.
    """
    filled = 0
    while filled < buffer.nbytes:
        count = response.readinto(buffer[filled:])
        if not count:
            if declared:
                raise http.client.IncompleteRead(b"", buffer.nbytes - filled)
            raise IntegrityError(f"the answer for {path} ended after {filled} of {buffer.nbytes} bytes")
        filled += count


def _lower(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers}
