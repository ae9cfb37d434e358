"""When a request to a ckptstore server is sent again, and for how long: one policy for every request.

Connection errors and 429/5xx answers are retried with exponential backoff and jitter (at most
:data:`MAX_PAUSE_SECONDS` a pause, longer when the server's ``Retry-After`` asks) for up to the
retry budget (``retry_seconds``, ``CKPTSTORE_RETRY_SECONDS``, default
:data:`DEFAULT_RETRY_SECONDS`: long enough to ride out a server restart; with no budget set, a
server that has never answered is tried for :data:`FIRST_REACH_SECONDS` only), but never 507 (the
server's disk is full: waiting frees nothing, so :class:`~service.errors.StorageFullError` is
raised at once with the server's message), and only for requests
that are safe to repeat: every request but a commit without a key. A save commits with an
``Idempotency-Key`` (a random token of its own), so its commit is retried like the rest: the
server answers a repeat with the version the key made. A commit without a key is sent again
only when its connection was refused or never opened (the server cannot have seen it); after
any other failure its outcome is unknown, so it is not retried.

The same :class:`RetryPolicy` runs JSON calls (httpx) and shard bytes (:mod:`client.http.bulk`);
the network errors of both are listed in :data:`NETWORK_ERRORS`.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import httpx

from ckptstore.client.http.route import Route
from ckptstore.service.errors import InvalidInputError, StorageError

#: Answers that pass with time. Not 507 (Insufficient Storage): a full disk stays full until freed.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: What a broken, refused or cut connection raises, through httpx or through the bulk connections.
NETWORK_ERRORS = (httpx.TransportError, OSError, http.client.HTTPException)
#: Failures before the request left this process: even a commit is safe to send again.
NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, ConnectionRefusedError)
#: How long requests safe to repeat are retried, by default: a server restart takes up to ~30 s.
DEFAULT_RETRY_SECONDS = 60.0
RETRY_SECONDS_VARIABLE = "CKPTSTORE_RETRY_SECONDS"
#: How long a client tries a server that has never answered it, unless a budget was set: a
#: server that is not there fails within seconds, one that answered once is waited for (restarts).
FIRST_REACH_SECONDS = 5.0
#: The longest pause between two tries of a request (unless the server's Retry-After asks for more).
MAX_PAUSE_SECONDS = 4.0
#: The longest pause a server's Retry-After may ask for.
MAX_RETRY_AFTER_SECONDS = 30.0
#: A commit: ``POST /v1/runs/<run>/versions``, the one request whose repeat could land twice.
COMMIT_PATH = re.compile(r"/v1/runs/[^/?]+/versions")
log = logging.getLogger("ckptstore.client")

R = TypeVar("R", bound="Reply")


class Reply(Protocol):
    """An answer as the policy and :func:`client.http.errors.raise_for_error` read it: an
    ``httpx.Response`` or a :class:`client.http.bulk.BulkResponse`."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> httpx.Headers | dict[str, str]: ...

    @property
    def content(self) -> bytes: ...

    @property
    def url(self) -> httpx.URL | str: ...

    def close(self) -> None: ...


def retry_budget(seconds: float | None = None) -> float:
    """Seconds to keep retrying: ``seconds``, else ``$CKPTSTORE_RETRY_SECONDS``, else the default.

    Raises:
        InvalidInputError: the value is not a number of seconds from 0 up.
    """
    source = "retry_seconds"
    if seconds is None:
        text = os.environ.get(RETRY_SECONDS_VARIABLE) or ""
        if not text.strip():
            return DEFAULT_RETRY_SECONDS
        source = RETRY_SECONDS_VARIABLE
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
    if isinstance(seconds, bool) or not 0 <= seconds <= 86400:
        raise InvalidInputError(f"{source} must be a number of seconds from 0 to 86400, not {seconds!r}")
    return float(seconds)


def budget_is_set(seconds: float | None = None) -> bool:
    """Whether someone chose the retry budget (``seconds``, or ``$CKPTSTORE_RETRY_SECONDS``):
    then a server that has not answered yet is tried for all of it, as they asked."""
    return seconds is not None or bool((os.environ.get(RETRY_SECONDS_VARIABLE) or "").strip())


@dataclass(frozen=True)
class RetryPolicy:
    """How every request to one server is retried.

    Args:
        seconds: the retry budget: how long a request safe to repeat is tried again.
        retries: at most this many retries of one request as well (None: as many as the budget allows).
        backoff_seconds: the first pause; each next one doubles, up to :data:`MAX_PAUSE_SECONDS`,
            and is drawn between half and all of that (jitter).
        warn: log a request's first retry as a warning (a long wait may follow); False logs it
            as info, for a short budget whose error, if it comes, says it all.
    """

    seconds: float = DEFAULT_RETRY_SECONDS
    retries: int | None = None
    backoff_seconds: float = 0.25
    warn: bool = True

    @classmethod
    def configured(
        cls, retry_seconds: float | None = None, retries: int | None = None, backoff_seconds: float = 0.25
    ) -> RetryPolicy:
        """The policy for these arguments, the budget defaulting to ``$CKPTSTORE_RETRY_SECONDS`` (checked)."""
        return cls(retry_budget(retry_seconds), retries, backoff_seconds)

    @staticmethod
    def safe_to_repeat(method: str, path: str) -> bool:
        """Whether a request may be sent again after a failure that leaves its outcome unknown,
        judged by its method and path: every request but a commit (reads, uploads named by their
        content, PUTs, DELETEs and POSTs that ask or sweep are idempotent). A commit with an
        ``Idempotency-Key`` is too: its sender says so (``run``'s ``repeatable``)."""
        return not (method.upper() == "POST" and COMMIT_PATH.fullmatch(path.partition("?")[0]))

    def pause(self, attempt: int, left: float, retry_after: str | None = None) -> float:
        """Seconds to wait before try ``attempt + 2``: backoff with jitter, at least what a
        ``Retry-After`` in seconds asks (up to :data:`MAX_RETRY_AFTER_SECONDS`), at most ``left``."""
        delay = min(MAX_PAUSE_SECONDS, self.backoff_seconds * 2**attempt) * (0.5 + random.random() / 2)
        if retry_after is not None and retry_after.strip().isdigit():
            delay = max(delay, min(float(retry_after), MAX_RETRY_AFTER_SECONDS))
        return min(delay, left)

    def run(
        self,
        route: Route,
        method: str,
        path: str,
        send: Callable[[], R],
        doing: str = "",
        *,
        repeatable: bool | None = None,
    ) -> R:
        """Call ``send`` (one try of ``method path`` to ``route``'s server) until it answers
        something other than a retryable status, the request is not safe to repeat, or the
        budget is spent; returns the last answer. ``repeatable`` overrides
        :meth:`safe_to_repeat` (a commit sent with an ``Idempotency-Key`` is safe to repeat).

        Raises:
            StorageError: the server could not be reached (naming it, why, and what to check;
                prefixed with ``doing`` when given).
        """
        idempotent = self.safe_to_repeat(method, path) if repeatable is None else repeatable
        started, attempt = time.monotonic(), 0
        while True:
            try:
                reply = send()
            except NETWORK_ERRORS as exc:
                safe = idempotent or isinstance(exc, NOT_SENT_ERRORS)
                if safe and self._wait(route, attempt, started, exc):
                    attempt += 1
                    continue
                what = "" if safe else " (a commit without a key is not retried: list the versions to see if it landed)"
                prefix = f"{doing} failed: " if doing else ""
                raise StorageError(prefix + self._unreachable(route, exc, attempt, started) + what) from exc
            if idempotent and reply.status_code in RETRY_STATUSES:
                retry_after = reply.headers.get("retry-after")
                if self._wait(route, attempt, started, f"HTTP {reply.status_code}", retry_after):
                    reply.close()
                    attempt += 1
                    continue
            return reply

    def _wait(self, route: Route, attempt: int, started: float, cause: object, retry_after: str | None = None) -> bool:
        """Pause before try ``attempt + 2`` of a request begun at ``started``; False once the
        budget (or the count of retries) is spent."""
        left = self.seconds - (time.monotonic() - started)
        if left <= 0 or (self.retries is not None and attempt >= self.retries):
            return False
        delay = self.pause(attempt, left, retry_after)
        # The first failure of a request is worth a warning: the call may now wait a while.
        log.log(
            logging.WARNING if attempt == 0 and self.warn else logging.INFO,
            "ckptstore server at %s: %s; retrying in %.1f s (giving up after %.0f s; %s sets how long)",
            route.url,
            cause,
            delay,
            self.seconds,
            RETRY_SECONDS_VARIABLE,
        )
        time.sleep(delay)
        return True

    def _unreachable(self, route: Route, exc: BaseException, attempt: int, started: float) -> str:
        """The message for a server that could not be reached: where, why, and what to check."""
        through = f" and the proxy {route.shown_proxy} (from the *_PROXY variables)" if route.proxy else ""
        why = "it took the connection but sent no answer in time" if isinstance(exc, httpx.ReadTimeout) else exc
        return (
            f"cannot reach the ckptstore server at {route.url}: {why}. Is the server running at {route.url}? "
            f"Check CKPTSTORE_URL{through} (gave up after {attempt + 1} tries in "
            f"{time.monotonic() - started:.1f} s; {RETRY_SECONDS_VARIABLE} sets how long to keep trying)"
        )
