"""Shard uploads sent straight to the blob store, where the server hands out signed URLs (S3).

A server whose blobs live in S3 answers ``POST /v1/shards/<id>/uploads`` with presigned ``PUT``
URLs of a staging key it chose: one for a shard up to its part size, one per part above. The
shard's header and tensor bytes go from memory to those URLs (the same keep-alive connections
as the server's, :class:`client.http.bulk.BulkHttp`, up to :data:`PARTS_IN_FLIGHT` parts at
once), so no shard byte passes through the server; then ``POST /v1/shards/<id>/uploads/<token>``
has the server verify them (header, id, every tensor's digest) and store them. Until it has,
nothing references them.

Fallbacks, so a save never fails where today's path works: a server without direct uploads
(409, or 404 from one that predates them) is asked once and then every upload goes through it
(``PUT /v1/shards/<id>``); a URL S3 refuses (403: expired, or a signature it no longer takes)
is asked for again once, and then the shard goes through the server; an S3 that cannot be
reached from here turns direct uploads off for this client. The URLs hold a signature: no log
line or error message shows more of one than its scheme, host and path.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from urllib.parse import urlsplit

from ckptstore.client.http.bulk import BulkHttp, carries
from ckptstore.client.http.retry import NETWORK_ERRORS, RETRY_STATUSES
from ckptstore.client.http.route import Route, route_for
from ckptstore.client.http.session import CONNECT_SECONDS, HttpSession
from ckptstore.service.errors import CheckpointError, ConflictError, InvalidInputError, NotFoundError, StorageError
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.secrets_mask import mask_url

log = logging.getLogger(__name__)

#: Parts of one shard sent at once (each on its own connection).
PARTS_IN_FLIGHT = 4
#: Tries of one PUT to S3 through network errors and 5xx answers, and the first pause between them.
S3_TRIES = 3
S3_PAUSE_SECONDS = 0.5
#: Socket timeout of each write to S3 and of waiting for its answer.
S3_TIMEOUT_SECONDS = 300.0
_S3_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")


class _Refused(Exception):
    """S3 refused a PUT (4xx): an expired URL, or a signature it does not take."""


class _Unreachable(Exception):
    """S3 could not be reached from here."""


class _Failed(Exception):
    """S3 kept failing a PUT (5xx)."""


@dataclass(frozen=True)
class Grant:
    """The server's answer to an upload request: ``urls[i]`` takes bytes ``[i * part_bytes, …)``."""

    token: str
    part_bytes: int
    urls: tuple[str, ...]


def shown(url: str) -> str:
    """``url`` fit for a message: its scheme, host and path, never its query (the signature)."""
    parts = urlsplit(url)
    return mask_url(f"{parts.scheme}://{parts.netloc}{parts.path}") + ("?…" if parts.query else "")


def cut(views: Sequence[memoryview], part_bytes: int) -> list[list[memoryview]]:
    """``views``' bytes, concatenated, as consecutive parts of ``part_bytes`` (the last shorter),
    each a list of slices of the views (no copy)."""
    parts: list[list[memoryview]] = [[]]
    room = part_bytes
    for view in views:
        while view.nbytes:
            if room == 0:
                parts.append([])
                room = part_bytes
            piece = view[:room]
            parts[-1].append(piece)
            room -= piece.nbytes
            view = view[piece.nbytes :]
    return parts


class DirectUploads:
    """Uploads of shards straight to S3 for one server's session (see the module's description).

    Args:
        session: the server's session (asks for URLs and has uploads verified, with its token).
        timeout_seconds: socket timeout for each write to S3 and for its answer.
    """

    def __init__(self, session: HttpSession, timeout_seconds: float = S3_TIMEOUT_SECONDS) -> None:
        self._session = session
        self._timeout = timeout_seconds
        self._wires: dict[str, BulkHttp] = {}  # one connection pool per storage origin
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        #: False once the server has said it takes none, or S3 could not be reached from here.
        self.offered = True

    def put_shard(
        self, shard_id: str, header: bytes, pieces: Sequence[memoryview], extra_headers: dict[str, str] | None = None
    ) -> ShardReceipt | None:
        """Upload a shard to S3 and have the server verify and store it; None when the shard is
        the server's to take (no direct uploads, or S3 refused or failed them). ``extra_headers``
        go with the request that has it stored (a save's ``Save-Key``).

        Raises:
            CheckpointError: the server refused the uploaded shard (IntegrityError: bytes that do
                not match their digests) or failed; as :meth:`HttpSession.request` raises them.
        """
        if not self.offered:
            return None
        body = [memoryview(header), *(_flat(piece) for piece in pieces)]
        size = sum(view.nbytes for view in body)
        for attempt in range(2):
            grant = self._ask(shard_id, size)
            if grant is None:
                return None
            try:
                self._send(grant, cut(body, grant.part_bytes))
            except _Refused as exc:
                self._abandon(shard_id, grant)
                if attempt == 0:
                    log.info("S3 refused the upload of shard %s (%s); asking the server for new URLs", shard_id, exc)
                    continue
                log.warning("S3 refused shard %s's upload again (%s); sending it through the server", shard_id, exc)
                return None
            except _Unreachable as exc:
                self._abandon(shard_id, grant)
                self.offered = False
                log.warning("cannot reach S3 from here (%s); this client sends every shard through the server", exc)
                return None
            except _Failed as exc:
                self._abandon(shard_id, grant)
                log.warning("S3 failed the upload of shard %s (%s); sending it through the server", shard_id, exc)
                return None
            try:
                return self._complete(shard_id, grant, size, extra_headers or {})
            except NotFoundError:
                if attempt == 0:  # the staged bytes went (an expired multipart upload, a sweep): once more
                    continue
                raise
        return None

    def _ask(self, shard_id: str, size: int) -> Grant | None:
        """The server's URLs for a shard of ``size`` bytes; None (and no more asking) where it has none."""
        try:
            answer = self._session.request("POST", f"/v1/shards/{shard_id}/uploads", json={"size": size})
        except (ConflictError, NotFoundError) as exc:  # no S3 blobs, or a server that predates direct uploads
            self.offered = False
            log.debug("the server takes shard uploads only through itself: %s", exc)
            return None
        except StorageError as exc:
            if isinstance(exc.__cause__, NETWORK_ERRORS):
                raise  # the server cannot be reached: sending the shard to it would wait as long again
            log.debug("the server could not sign an upload of shard %s (%s); sending it through it", shard_id, exc)
            return None  # it answered 5xx (its S3 failed): this shard goes through it
        data = answer.json()
        urls, part_bytes, token = data.get("urls"), data.get("part_bytes"), data.get("upload")
        valid = isinstance(urls, list) and urls and all(isinstance(url, str) for url in urls)
        if not (valid and isinstance(part_bytes, int) and part_bytes > 0 and isinstance(token, str)):
            self.offered = False
            log.warning("the server's upload URLs for shard %s are malformed; sending shards through it", shard_id)
            return None
        return Grant(token=token, part_bytes=part_bytes, urls=tuple(urls))

    def _send(self, grant: Grant, parts: list[list[memoryview]]) -> None:
        if len(parts) != len(grant.urls):
            raise _Failed(f"the server planned {len(grant.urls)} parts for {len(parts)} parts' worth of bytes")
        if len(parts) == 1:
            self._put(grant.urls[0], parts[0])
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="ckptstore-part")
            pool = self._pool
        futures: list[Future[None]] = [
            pool.submit(self._put, url, part) for url, part in zip(grant.urls, parts, strict=True)
        ]
        _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        wait(pending)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                future.result()

    def _put(self, url: str, pieces: list[memoryview]) -> None:
        """PUT ``pieces`` to ``url``, retried through network errors and 5xx answers.

        Raises:
            _Refused: S3 answered 4xx. _Unreachable: no connection could be made. _Failed: 5xx throughout.
        """
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        failure = ""
        for attempt in range(S3_TRIES):
            if attempt:
                time.sleep(S3_PAUSE_SECONDS * 2 ** (attempt - 1))
            wire = self._wire(origin)
            try:
                answer = wire.put(target, pieces, {})
            except NETWORK_ERRORS as exc:
                failure = f"{type(exc).__name__}: {exc}"
                continue
            if answer.status_code < 300:
                return
            found = _S3_CODE.search(answer.content[:4096])
            code = found.group(1).decode() if found else ""
            failure = f"HTTP {answer.status_code} {code}".strip() + f" from {shown(url)}"
            if answer.status_code not in RETRY_STATUSES:
                raise _Refused(failure)
        if failure.startswith("HTTP"):
            raise _Failed(failure)
        raise _Unreachable(f"{shown(url)}: {failure}")

    def _wire(self, origin: str) -> BulkHttp:
        """The connections to ``origin``, after checking once that it can be reached at all.

        Raises:
            _Unreachable: it cannot (within :data:`CONNECT_SECONDS`), or only by a route these
                connections cannot take.
        """
        with self._lock:
            wire = self._wires.get(origin)
        if wire is not None:
            return wire
        try:
            route = route_for(origin)
        except InvalidInputError as exc:
            raise _Unreachable(f"{shown(origin)} is not an http(s) URL") from exc
        if not carries(route):
            raise _Unreachable(f"{shown(origin)} is behind an https proxy, which these uploads cannot pass")
        _probe(route)
        # No server headers: the token is the server's, never the blob store's.
        wire = BulkHttp(route, {}, self._timeout)
        with self._lock:
            return self._wires.setdefault(origin, wire)

    def _complete(self, shard_id: str, grant: Grant, size: int, headers: dict[str, str]) -> ShardReceipt:
        path = f"/v1/shards/{shard_id}/uploads/{grant.token}"
        answer = self._session.request("POST", path, json={"size": size}, headers=headers)
        return ShardReceipt.model_validate_json(answer.content)

    def _abandon(self, shard_id: str, grant: Grant) -> None:
        """Ask the server to delete what was sent under ``grant`` (garbage collection would, later)."""
        try:
            self._session.request("DELETE", f"/v1/shards/{shard_id}/uploads/{grant.token}")
        except CheckpointError as exc:
            log.debug("could not remove the abandoned upload of shard %s: %s", shard_id, exc)

    def close(self) -> None:
        """Close every connection to S3 and stop the part senders."""
        with self._lock:
            wires, self._wires = list(self._wires.values()), {}
            pool, self._pool = self._pool, None
        for wire in wires:
            wire.close()
        if pool is not None:
            pool.shutdown(wait=False)


def _probe(route: Route) -> None:
    """Raise _Unreachable unless a TCP connection to ``route``'s first hop opens within :data:`CONNECT_SECONDS`."""
    hop = urlsplit(route.proxy or route.url)
    https = hop.scheme == "https"
    try:
        socket.create_connection((hop.hostname or "", hop.port or (443 if https else 80)), CONNECT_SECONDS).close()
    except OSError as exc:
        raise _Unreachable(f"{shown(route.url)}: {exc}") from exc


def _flat(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


_uploads: weakref.WeakKeyDictionary[HttpSession, DirectUploads] = weakref.WeakKeyDictionary()
_uploads_lock = threading.Lock()


def uploads_for(session: HttpSession) -> DirectUploads:
    """The direct uploads of ``session``'s client, made on first use and closed with the session."""
    with _uploads_lock:
        found = _uploads.get(session)
        if found is None:
            found = _uploads[session] = DirectUploads(session)
            weakref.finalize(session, found.close)
        return found


__all__ = ["DirectUploads", "Grant", "cut", "shown", "uploads_for"]
