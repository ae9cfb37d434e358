"""Every request to one ckptstore server, on one route, under one retry policy, through one error boundary.

JSON calls go through httpx; shard bytes through :mod:`client.http.bulk`'s connections, which
hand tensor memory to the socket and read answers straight into it (measured faster for
multi-MiB bodies). Both take the same :class:`client.http.route.Route` (the proxy the
environment names, one TLS context), both are retried by the same
:class:`client.http.retry.RetryPolicy`, and both answers pass :func:`client.http.errors.raise_for_error`.

By default a session is patient, as a training job's client should be: each try may wait
:data:`CONNECT_SECONDS` to connect and the session's timeout for an answer, and a request safe to
repeat is retried for the policy's whole budget (a server restart). A command someone waits on
calls :meth:`HttpSession.limit_waiting` to give up within seconds on a server it cannot reach.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import httpx

from ckptstore.client.http import bulk as bulk_wire
from ckptstore.client.http.bulk import BulkHttp, BulkWire, HttpxBulk, carries
from ckptstore.client.http.errors import raise_for_error
from ckptstore.client.http.retry import Reply, RetryPolicy
from ckptstore.client.http.route import Route, route_for

R = TypeVar("R", bound=Reply)

#: How long one try waits for a TCP (and TLS) connection to the server, by default.
CONNECT_SECONDS = 10.0
#: What the server answers at once, asked whether it answers at all (see :meth:`HttpSession.limit_waiting`).
HEALTH_PATH = "/healthz"


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
        self._timeout_seconds = timeout_seconds
        #: The timeouts of a metadata call (see :meth:`request`): the session's until :meth:`limit_waiting`.
        self._metadata_timeout = httpx.Timeout(timeout_seconds, connect=CONNECT_SECONDS)
        #: The policy of requests sent before the server first answers (None: :attr:`policy`).
        self._reaching: RetryPolicy | None = None
        self._reached = False
        #: Whether a long call sent before the server first answered is preceded by a health probe
        #: (after :meth:`limit_waiting`, whose answer timeouts are short).
        self._probe_first = False
        self._http = httpx.Client(
            base_url=self.route.url,
            headers=headers,
            timeout=httpx.Timeout(timeout_seconds, connect=CONNECT_SECONDS),
            limits=httpx.Limits(
                max_connections=16, max_keepalive_connections=16, keepalive_expiry=bulk_wire.IDLE_REUSE_SECONDS
            ),
            # The route already holds what the environment says (proxy, CA bundle): httpx is
            # told it rather than reading the environment again.
            verify=self.route.tls or False,
            proxy=self.route.httpx_proxy(),
            trust_env=False,
        )
        self.bulk: BulkWire = (
            BulkHttp(self.route, headers, timeout_seconds) if carries(self.route) else HttpxBulk(self._http)
        )

    def reach_within(self, seconds: float) -> None:
        """Until the server first answers, retry a request for at most ``seconds`` (not the
        policy's whole budget) and without a logged warning: a server that is not there is an
        error within seconds, naming its URL; once it has answered, the whole budget applies.
        Only failures to connect are at stake (nothing was sent), so no probe precedes a call."""
        self._reaching = replace(self.policy, seconds=min(self.policy.seconds, seconds), warn=False)

    def limit_waiting(self, *, reach_seconds: float | None, answer_seconds: float) -> None:
        """Give up sooner on a server that cannot be reached or does not answer: for a command
        someone waits on, not for a training job (whose client keeps the patient defaults).

        Until the server first answers, a request is retried for at most ``reach_seconds`` (not
        the policy's whole budget) and without a logged warning (the error says it all); every
        try waits at most ``reach_seconds`` (up to :data:`CONNECT_SECONDS`) to connect, and a
        metadata call at most ``answer_seconds`` for its answer. Shard transfers and the calls
        that make the server work (commit, gc) keep the session's timeout for an answer; sent
        before the server has answered, they are preceded by ``GET /healthz`` under these
        limits (any answer will do). Once the server has answered, failures are retried for
        the policy's whole budget.

        Args:
            reach_seconds: how long to keep trying a server that has not answered yet (None:
                the policy's whole budget, as someone who set it asked).
            answer_seconds: how long a metadata call waits for the server's answer.
        """
        connect = CONNECT_SECONDS
        if reach_seconds is not None:
            connect = min(CONNECT_SECONDS, max(reach_seconds, 0.1))
            self._reaching = replace(self.policy, seconds=min(self.policy.seconds, reach_seconds), warn=False)
            self._probe_first = True
        self._metadata_timeout = httpx.Timeout(answer_seconds, connect=connect)
        self._http.timeout = httpx.Timeout(self._timeout_seconds, connect=connect)

    def request(
        self, method: str, path: str, *, metadata: bool = False, repeatable: bool | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send a request through httpx (``kwargs`` as ``httpx.Client.request`` takes them); returns its answer.

        ``metadata`` marks a small call the server answers at once (a listing, a manifest, a
        tag): after :meth:`limit_waiting` it waits only that long for its answer. ``repeatable``
        says whether the request is safe to send again (None: as the policy judges its path;
        a commit with an ``Idempotency-Key`` is).

        Raises:
            CheckpointError: the class an error answer stands for; StorageError when the server
                could not be reached.
        """
        if metadata:
            kwargs["timeout"] = self._metadata_timeout

        def send() -> httpx.Response:
            return self._http.request(method, path, **kwargs)

        return self._run(method, path, send, metadata=metadata, repeatable=repeatable)

    def put_bytes(
        self, path: str, pieces: Sequence[bytes | memoryview], headers: dict[str, str], doing: str, method: str = "PUT"
    ) -> Reply:
        """PUT (or ``method``) the concatenation of ``pieces`` straight from memory; returns the answer, read.

        Raises:
            CheckpointError: as :meth:`request`, a StorageError's message beginning with ``doing``.
        """
        return self._run(method, path, lambda: self.bulk.put(path, pieces, headers, method), doing)

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

    def _run(
        self,
        method: str,
        path: str,
        send: Callable[[], R],
        doing: str = "",
        *,
        metadata: bool = False,
        repeatable: bool | None = None,
    ) -> R:
        """One request under the policy (the reaching one until the server first answers); an error
        answer raised as its CheckpointError."""
        reaching = None if self._reached else self._reaching
        if reaching is not None and self._probe_first and not metadata:
            # This call may rightly wait long for its answer (the server works, or bytes flow):
            # whether the server answers at all is asked first, with a call it answers at once.
            def probe() -> httpx.Response:
                return self._http.get(HEALTH_PATH, timeout=self._metadata_timeout)

            reaching.run(self.route, "GET", HEALTH_PATH, probe, doing).close()
            self._reached, reaching = True, None
        reply = (reaching or self.policy).run(self.route, method, path, send, doing, repeatable=repeatable)
        self._reached = True
        raise_for_error(reply)
        return reply

    def close(self) -> None:
        """Close every connection."""
        self.bulk.close()
        self._http.close()
