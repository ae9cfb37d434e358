"""Shard bytes read straight from the blob store, where the server hands out signed URLs (S3).

A server whose blobs live in S3 answers ``POST /v1/shards/urls`` with a presigned GET URL per
shard. Reading a shard's byte range from that URL moves the bytes from S3 to this process without
passing through the server, whose CPU and network then carry only metadata. Every byte read this
way is checked against its digest by the load path, exactly as bytes the server sends are, so a
URL or an object that serves wrong bytes is caught.

URLs are asked for in batches (:meth:`DirectReads.learn`, as a load locates its tensors) and
used until they expire; a shard read without being located first is read through the server.
A read whose URL S3 refuses (expired, or a signature the store no longer accepts) asks for a
fresh URL once; any other failure, and a server without URLs, leaves the read to the server
(:meth:`DirectReads.read` returns False). The URLs hold a signature: they are never logged, and
an error message shows them masked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from ckptstore.client.http.bulk import BulkHttp, carries
from ckptstore.client.http.route import route_for
from ckptstore.client.http.session import HttpSession
from ckptstore.service.errors import CheckpointError, InvalidInputError
from ckptstore.service.secrets_mask import mask_url, mask_urls

log = logging.getLogger(__name__)

URLS_PATH = "/v1/shards/urls"
#: Most shards asked about in one request (the server's own cap).
BATCH = 1024
#: A URL this close to its expiry is asked for again rather than used.
MARGIN_SECONDS = 30.0


class DirectReads:
    """Signed read URLs of shards, and ranged GETs from them.

    Args:
        session: the server's session (asks for URLs with its token).
        timeout_seconds: socket timeout for each read from the blob store.
    """

    def __init__(self, session: HttpSession, timeout_seconds: float) -> None:
        self._session = session
        self._timeout = timeout_seconds
        self._urls: dict[str, tuple[str, float]] = {}  # shard id -> (URL, monotonic deadline)
        self._wires: dict[str, BulkHttp] = {}  # one connection pool per storage origin
        self._lock = threading.Lock()
        #: False once the server has said it has no URLs to give: every read then goes through it.
        self.offered = True

    def learn(self, shard_ids: Iterable[str]) -> None:
        """Ask the server for URLs of those of ``shard_ids`` not known yet (or soon expiring)."""
        if not self.offered:
            return
        now = time.monotonic()
        with self._lock:
            wanted = [s for s in dict.fromkeys(shard_ids) if self._urls.get(s, ("", 0.0))[1] <= now + MARGIN_SECONDS]
        for start in range(0, len(wanted), BATCH):
            batch = wanted[start : start + BATCH]
            found = self._session.request("POST", URLS_PATH, metadata=True, json={"shards": batch}).json()
            urls, seconds = found.get("urls") or {}, found.get("expires_in") or 0
            if not urls:
                self.offered = False
                return
            deadline = time.monotonic() + float(seconds)
            with self._lock:
                self._urls.update({shard_id: (url, deadline) for shard_id, url in urls.items()})

    def read(self, shard_id: str, offset: int, buffers: Sequence[memoryview]) -> bool:
        """Fill ``buffers`` from ``shard_id``'s bytes at ``offset`` straight from the blob store.

        Returns False, having written nothing the caller relies on, when the read is the
        server's to do: no URL is offered, or the blob store failed it.
        """
        length = sum(buffer.nbytes for buffer in buffers)
        if not self.offered or length == 0:
            return False
        for attempt in range(2):
            url = self._url(shard_id, refresh=attempt > 0)
            if url is None:
                return False
            status = self._get(url, offset, length, buffers)
            if status == 206:
                return True
            if status not in (400, 401, 403):  # anything but a refused signature is the server's to sort out
                return False
        return False

    def _url(self, shard_id: str, *, refresh: bool) -> str | None:
        """The shard's URL: one learned as the load located its tensors (none asked for here, so
        a read of a shard never located goes to the server), or a fresh one after a refusal."""
        with self._lock:
            known = self._urls.pop(shard_id, None) if refresh else self._urls.get(shard_id)
        if not refresh:
            return known[0] if known is not None and known[1] > time.monotonic() else None
        try:
            self.learn([shard_id])
        except CheckpointError as exc:
            log.debug("no read URL for shard %s: %s", shard_id, exc)
            return None
        with self._lock:
            fresh = self._urls.get(shard_id)
        return fresh[0] if fresh is not None else None

    def _get(self, url: str, offset: int, length: int, buffers: Sequence[memoryview]) -> int:
        """The status of a ranged GET of ``url`` into ``buffers`` (0 when it could not be made)."""
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            wire = self._wire(origin)
            if wire is None:
                return 0
            answer = wire.get_into(target, {"Range": f"bytes={offset}-{offset + length - 1}"}, buffers)
        except (OSError, CheckpointError) as exc:
            log.debug("reading shard bytes from %s failed: %s", mask_url(url), mask_urls(str(exc)))
            return 0
        return answer.status_code

    def _wire(self, origin: str) -> BulkHttp | None:
        with self._lock:
            wire = self._wires.get(origin)
            if wire is None:
                try:
                    route = route_for(origin)
                except InvalidInputError:
                    return None
                if not carries(route):
                    return None
                # No server headers: the token is the server's, never the blob store's.
                wire = self._wires[origin] = BulkHttp(route, {}, self._timeout)
            return wire

    def close(self) -> None:
        """Close every connection to the blob store."""
        with self._lock:
            wires, self._wires = list(self._wires.values()), {}
        for wire in wires:
            wire.close()
