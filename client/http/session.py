"""Every request to one ckptstore server, on one route, under one retry policy, through one error boundary.

JSON calls go through httpx; shard bytes through :mod:`client.http.bulk`'s connections, which
hand tensor memory to the socket and read answers straight into it (measured faster for
multi-MiB bodies). Both take the same :class:`client.http.route.Route` (the proxy the
environment names, one TLS context), both are retried by the same
:class:`client.http.retry.RetryPolicy`, and both answers pass :func:`client.http.errors.raise_for_error`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httpx

from client.http.bulk import BulkHttp, BulkWire, HttpxBulk, carries
from client.http.errors import raise_for_error
from client.http.retry import Reply, RetryPolicy
from client.http.route import Route, route_for

R = TypeVar("R", bound=Reply)


class HttpSession:
    """Connections to the server at ``url``, pooled, reached as the environment says.

    Args:
        url: ``http(s)://host[:port][/prefix]``.
        headers: sent with every request (authorization, user agent).
        policy: how failed requests are retried.
        timeout_seconds: how long one request may wait for the server.

    Raises:
        InvalidInputError: ``url`` is not an http(s) URL.
    """

    def __init__(self, url: str, headers: dict[str, str], policy: RetryPolicy, timeout_seconds: float) -> None:
        self.route: Route = route_for(url)
        self.policy = policy
        self._http = httpx.Client(
            base_url=self.route.url,
            headers=headers,
            timeout=httpx.Timeout(timeout_seconds, connect=10.0),
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=16),
            # The route already holds what the environment says (proxy, CA bundle): httpx is
            # told it rather than reading the environment again.
            verify=self.route.tls or False,
            proxy=self.route.httpx_proxy(),
            trust_env=False,
        )
        self.bulk: BulkWire = (
            BulkHttp(self.route, headers, timeout_seconds) if carries(self.route) else HttpxBulk(self._http)
        )

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send a request through httpx (``kwargs`` as ``httpx.Client.request`` takes them); returns its answer.

        Raises:
            CheckpointError: the class an error answer stands for; StorageError when the server
                could not be reached.
        """
        return self._run(method, path, lambda: self._http.request(method, path, **kwargs))

    def put_bytes(self, path: str, pieces: Sequence[bytes | memoryview], headers: dict[str, str], doing: str) -> Reply:
        """PUT the concatenation of ``pieces`` straight from memory; returns the answer, read.

        Raises:
            CheckpointError: as :meth:`request`, a StorageError's message beginning with ``doing``.
        """
        return self._run("PUT", path, lambda: self.bulk.put(path, pieces, headers), doing)

    def get_into(self, path: str, headers: dict[str, str], buffers: Sequence[memoryview], doing: str) -> Reply:
        """GET ``path``, its body received straight into ``buffers`` (exactly filled); returns the answer.

        Raises:
            IntegrityError: the body is longer or shorter than the buffers.
            CheckpointError: as :meth:`put_bytes`.
        """
        return self._run("GET", path, lambda: self.bulk.get_into(path, headers, buffers), doing)

    def post_into(
        self, path: str, body: bytes, headers: dict[str, str], buffers: Sequence[memoryview], doing: str
    ) -> Reply:
        """POST ``body`` (a read that is safe to repeat), the answer's body received straight into
        ``buffers`` (exactly filled); returns the answer.

        Raises:
            IntegrityError: the body is longer or shorter than the buffers.
            CheckpointError: as :meth:`put_bytes`.
        """
        return self._run("POST", path, lambda: self.bulk.post_into(path, body, headers, buffers), doing)

    def _run(self, method: str, path: str, send: Callable[[], R], doing: str = "") -> R:
        """One request under the policy; an error answer raised as its CheckpointError."""
        reply = self.policy.run(self.route, method, path, send, doing)
        raise_for_error(reply)
        return reply

    def close(self) -> None:
        """Close every connection."""
        self.bulk.close()
        self._http.close()
