"""The client's HTTP transport: the same operations as the embedded store, over the v1 API.

Each operation is one request through :class:`client.http.session.HttpSession`: JSON calls
through httpx, shard uploads straight from memory and ranged shard reads straight into it,
all on the route the proxy variables name and under one
:class:`client.http.retry.RetryPolicy` (a time budget, ``retry_seconds`` /
``CKPTSTORE_RETRY_SECONDS``; a save's commit is sent again only under its ``Idempotency-Key``,
which commits it once). Error answers become the same
exception classes the embedded store raises (:func:`client.http.errors.raise_for_error`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pydantic import TypeAdapter

from ckptstore.client.http.direct_reads import DirectReads
from ckptstore.client.http.direct_uploads import uploads_for
from ckptstore.client.http.retry import FIRST_REACH_SECONDS, RetryPolicy, budget_is_set
from ckptstore.client.http.session import HttpSession
from ckptstore.client.http.unhashed_uploads import hashed_shard, send_unhashed
from ckptstore.service import __version__
from ckptstore.service.errors import CheckpointError, IntegrityError, NotFoundError, RangeNotSatisfiableError
from ckptstore.service.format.digest import shard_id as digest_shard_id
from ckptstore.service.format.manifest import Manifest, ManifestBody, manifest_from_json
from ckptstore.service.format.names import validate_commit_key, validate_run_id
from ckptstore.service.format.records import (
    GcReport,
    MetadataProblem,
    RetentionPolicy,
    RunInfo,
    ShardReceipt,
    TensorLocation,
    VersionInfo,
)
from ckptstore.service.format.sharding import MAX_SIZES_PER_REQUEST, UnhashedTensor
from ckptstore.service.secrets_mask import mask_url

log = logging.getLogger(__name__)
#: A range this large is read from the blob store directly when the server signs URLs; smaller
#: ones go together in one request to the server, where one GET each would cost more round trips.
DIRECT_MIN_BYTES = 256 << 10
#: Shards a save sends to a server at once.
HTTP_UPLOADS_IN_FLIGHT = 4
#: Reads a load over HTTP runs at once. A server sends shard bytes with ``sendfile``, so more
#: requests cost it little: on a 2-core VM, a 512 MiB load from cold files took 0.424 s with
#: two at once and 0.391 s with four (medians of 9, the embedded load 0.32 s).
HTTP_READS_IN_PARALLEL = 4

#: Upload staging folders were ``<tmp>/ckptstore-upload-<pid>-<random>`` (clients no longer make them).
STAGING_PREFIX = "ckptstore-upload-"
#: A staging folder untouched this long whose process is gone was left by a killed client.
STALE_STAGING_SECONDS = 3600.0


@functools.cache
def _locations() -> TypeAdapter[dict[str, TensorLocation]]:
    """The validator of a locate answer, built on first use (a CLI command never needs it)."""
    return TypeAdapter(dict[str, TensorLocation])


def _owner_gone(name: str) -> bool:
    """Whether the process named in a staging folder's name has ended.

    False for a name without a process id (made by an older version, whose owner cannot be
    known): such a folder is left alone rather than risk removing a live client's.
    """
    pid_text, dash, _ = name[len(STAGING_PREFIX) :].partition("-")
    if not dash or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False  # another user's process, or a number no process can have: leave it alone
    return False


def remove_stale_staging(
    parent: Path | None = None, older_than_seconds: float = STALE_STAGING_SECONDS, now: float | None = None
) -> int:
    """Delete upload staging folders that killed clients left in ``parent`` (default: the temp folder).

    A folder goes only if it is older than ``older_than_seconds`` (since its last change) and
    the process named in it no longer runs, so a live client's folder is never touched, even
    an idle one (unless it runs in another PID namespace sharing this temp folder and sat idle
    past the threshold). Returns how many folders were removed.
    """
    parent = Path(tempfile.gettempdir()) if parent is None else parent
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(STAGING_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime < older_than_seconds or not _owner_gone(entry.name):
                continue
        except FileNotFoundError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed += not os.path.lexists(entry.path)
    return removed


def _ref(ref: int | str) -> str:
    return quote(str(ref), safe="")


def save_headers(save_key: str | None) -> dict[str, str]:
    """The ``Save-Key`` header naming the save a call is part of (none without one)."""
    return {} if save_key is None else {"Save-Key": validate_commit_key(save_key)}


class HttpTransport:
    """Talks to a ckptstore server at ``url`` (``http://host:port``).

    Patient by default, as a training job's client should be: once the server has answered,
    a request safe to repeat is retried for the whole retry budget (60 s unless set), long
    enough to ride out a server restart. A server that has never answered (nothing listening,
    a wrong ``CKPTSTORE_URL``) is tried for :data:`~client.http.retry.FIRST_REACH_SECONDS`
    unless a budget was set. The command line calls :meth:`limit_waiting` to give up within
    seconds on a server that does not answer either.
    """

    #: Work such as a garbage collection runs on the server, not in this process.
    remote = True

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        retry_seconds: float | None = None,
        retries: int | None = None,
        backoff_seconds: float = 0.25,
        timeout_seconds: float = 300.0,
    ) -> None:
        """Connect lazily to the server at ``url``.

        Args:
            url: ``http://host:port`` (or https).
            token: bearer token.
            retry_seconds: how long a request safe to repeat is retried through connection
                errors and 429/5xx answers (default ``$CKPTSTORE_RETRY_SECONDS``, else 60).
            retries: at most this many retries of one request as well (default: as many as
                the budget allows).
            backoff_seconds: the first pause; each next one doubles, up to MAX_PAUSE_SECONDS.
            timeout_seconds: how long one request may wait for the server.

        Raises:
            InvalidInputError: ``url`` is not an http(s) URL, or the retry budget is not a
                number of seconds.
        """
        headers = {"User-Agent": f"ckptstore/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._takes_unhashed: bool | None = None  # learnt from the server's first sizes answer
        self.url = url.rstrip("/")
        self.policy = RetryPolicy.configured(retry_seconds, retries, backoff_seconds)
        self.session = HttpSession(self.url, headers, self.policy, timeout_seconds)
        if not budget_is_set(retry_seconds):
            self.session.reach_within(FIRST_REACH_SECONDS)
        #: Shard bytes straight from the blob store where the server signs read URLs (S3).
        self.direct_reads = DirectReads(self.session, timeout_seconds)
        # Older clients staged uploads in temporary folders; one killed mid-save left its folder.
        remove_stale_staging()

    @property
    def location(self) -> str:
        """The server's URL, secrets masked (the Transport protocol's ``location``)."""
        return mask_url(self.url)

    def limit_waiting(self, *, reach_seconds: float | None, answer_seconds: float) -> None:
        """Give up within seconds on a server that cannot be reached or does not answer, for a
        command someone waits on (:meth:`client.http.session.HttpSession.limit_waiting`).

        A training job's client should not call this: it keeps retrying for the whole retry
        budget, so a server restart costs it a pause rather than its run. Transfers keep their
        timeouts either way, and once the server has answered, the whole budget applies again.

        Args:
            reach_seconds: how long to keep trying a server that has not answered yet (None:
                the whole retry budget).
            answer_seconds: how long a metadata call (a listing, a manifest, a tag) waits for
                the server's answer.
        """
        self.session.limit_waiting(reach_seconds=reach_seconds, answer_seconds=answer_seconds)

    @property
    def retry_seconds(self) -> float:
        """The retry budget: how long a request safe to repeat is tried again."""
        return self.policy.seconds

    def _json(self, method: str, path: str, *, metadata: bool = False, **kwargs: Any) -> Any:
        """One JSON call, its answer decoded (None when empty); ``metadata`` marks a small one
        the server answers at once (see :meth:`client.http.session.HttpSession.request`)."""
        response = self.session.request(method, path, metadata=metadata, **kwargs)
        return response.json() if response.content else None

    # -- the Transport protocol ----------------------------------------------------------

    def missing(self, digests: Iterable[str], *, save_key: str | None = None) -> list[str]:
        """Digests the server lacks; those it has are held for the save ``save_key`` names (sent as
        ``Save-Key``). Asking again is safe: it only renews the holds."""
        wanted = list(dict.fromkeys(digests))
        if not wanted:
            return []
        answer = self._json("POST", "/v1/tensors/missing", json={"digests": wanted}, headers=save_headers(save_key))
        return list(answer["missing"])

    def put_tensors(
        self,
        tensors: Sequence[UnhashedTensor],
        on_bytes: Callable[[int], object] | None = None,
        *,
        save_key: str | None = None,
    ) -> tuple[ShardReceipt, list[str]]:
        """Store tensors not hashed yet as one shard: the server hashes them as it writes them
        (:mod:`client.http.unhashed_uploads`); returns the receipt and their digests in order.

        Where the server does not take them so (it predates that, or its blobs are in S3 and take
        uploads directly), they are hashed here and sent as a shard (:meth:`put_shard`).
        """
        sent: tuple[ShardReceipt, list[str]] | None = None
        if self.takes_unhashed:
            try:
                sent = send_unhashed(self.session, tensors, save_headers(save_key))
            except NotFoundError:  # a server without the route
                self.takes_unhashed = False
        if sent is None:
            header, pieces, digests = hashed_shard(tensors)
            sent = self.put_shard(header, pieces, save_key=save_key), digests
        if on_bytes is not None:
            on_bytes(sum(tensor.data.nbytes for tensor in tensors))
        return sent

    @property
    def takes_unhashed(self) -> bool:
        """Whether new tensors go to the server unhashed (:mod:`client.http.unhashed_uploads`): not
        where it predates that, or sends shard bytes to S3 directly (asked once, then learnt from
        each :meth:`sizes_held` answer)."""
        if self._takes_unhashed is None:
            self.sizes_held(())
        return bool(self._takes_unhashed)

    @takes_unhashed.setter
    def takes_unhashed(self, value: bool) -> None:
        self._takes_unhashed = value

    @property
    def may_take_unhashed(self) -> bool:
        """Whether new tensors may go to the server unhashed: False once it said it takes none,
        True until then (asks nothing; the first :meth:`sizes_held` answer tells)."""
        return self._takes_unhashed is not False

    def sizes_held(self, sizes: Iterable[int]) -> set[int]:
        """Those of ``sizes`` (byte lengths) some stored tensor has; all of them where the server
        takes no unhashed tensors (then a save hashes everything first)."""
        wanted = sorted(set(sizes))
        if not wanted and self._takes_unhashed is not None:
            return set()
        held: set[int] = set()
        try:
            for start in range(0, max(len(wanted), 1), MAX_SIZES_PER_REQUEST):
                asked = {"sizes": wanted[start : start + MAX_SIZES_PER_REQUEST]}
                answer = self._json("POST", "/v1/tensors/sizes", metadata=True, json=asked)
                held.update(answer["held"])
                self._takes_unhashed = not answer.get("direct_uploads", True)
        except NotFoundError:  # a server that predates unhashed uploads
            self._takes_unhashed = False
        return held & set(wanted) if self._takes_unhashed else set(wanted)

    def put_shard(
        self,
        header: bytes,
        pieces: Sequence[memoryview],
        on_bytes: Callable[[int], object] | None = None,
        *,
        save_key: str | None = None,
    ) -> ShardReceipt:
        """Upload a shard straight from memory: its header bytes, then its tensors' bytes.

        Where the server's blobs are in S3, the bytes go to S3 directly and the server then
        verifies them there (:mod:`client.http.direct_uploads`); otherwise, or when S3 refuses
        them, they go through the server, which checks the id and hashes every tensor as the
        body arrives. Retried on network errors and 429/5xx answers (an upload is idempotent). Its
        tensors are held for the save ``save_key`` names.
        """
        shard_id = digest_shard_id(header)
        receipt = uploads_for(self.session).put_shard(shard_id, header, pieces, save_headers(save_key))
        if receipt is None:
            body = [memoryview(header), *pieces]
            headers = {"Content-Type": "application/octet-stream", **save_headers(save_key)}
            answer = self.session.put_bytes(f"/v1/shards/{shard_id}", body, headers, f"uploading shard {shard_id}")
            receipt = ShardReceipt.model_validate_json(answer.content)
        if on_bytes is not None:
            on_bytes(sum(piece.nbytes for piece in pieces))
        return receipt

    def commit(
        self, run_id: str, body: ManifestBody, *, tags: Sequence[str] = (), commit_key: str | None = None
    ) -> VersionInfo:
        """Commit a version. With a ``commit_key`` (sent as ``Idempotency-Key``) a failed try is
        retried like any other request: the server answers a repeat with the version the key
        made. Without one, only a try that never reached the server is (its outcome is known)."""
        payload = '{"manifest":' + body.model_dump_json() + ',"tags":' + json.dumps(list(tags)) + "}"
        headers = {"Content-Type": "application/json"}
        if commit_key is not None:
            headers["Idempotency-Key"] = validate_commit_key(commit_key)
        data = self._json(
            "POST",
            f"/v1/runs/{quote(validate_run_id(run_id))}/versions",
            content=payload.encode(),
            headers=headers,
            repeatable=commit_key is not None,
        )
        return VersionInfo.model_validate(data)

    def resolve(self, run_id: str, ref: int | str = "latest") -> int:
        """The version number ``ref`` names."""
        data = self._json("GET", f"/v1/runs/{quote(validate_run_id(run_id))}/refs/{_ref(ref)}", metadata=True)
        return int(data["version"])

    def manifest(self, run_id: str, ref: int | str = "latest") -> Manifest:
        """A version's manifest."""
        path = f"/v1/runs/{quote(validate_run_id(run_id))}/versions/{_ref(ref)}"
        return manifest_from_json(self.session.request("GET", path, metadata=True).content)

    def check_metadata(self, run_id: str, ref: int | str = "latest") -> list[MetadataProblem]:
        """What differs in a version's stored metadata from the digests covering it (empty: nothing)."""
        path = f"/v1/runs/{quote(validate_run_id(run_id))}/versions/{_ref(ref)}/metadata-check"
        return [MetadataProblem.model_validate(item) for item in self._json("GET", path, metadata=True)]

    def locate(self, digests: Iterable[str]) -> dict[str, TensorLocation]:
        """Where each digest's bytes live."""
        wanted = list(dict.fromkeys(digests))
        if not wanted:
            return {}
        answer = self.session.request("POST", "/v1/tensors/locate", json={"digests": wanted})
        locations = _locations().validate_json(answer.content)
        try:  # the reads that follow go to the blob store where the server signs URLs for them
            self.direct_reads.learn(location.shard_id for location in locations.values())
        except NotFoundError:  # a server that predates read URLs: it serves every read
            self.direct_reads.offered = False
        except CheckpointError as exc:
            log.debug("no read URLs this time (%s); reads go through the server", exc)
        return locations

    def will_read(self, shard_id: str, spans: Sequence[tuple[int, int]]) -> None:
        """Nothing to start ahead here: each range is asked for when it is read."""

    def read_into(self, shard_id: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from a byte range of a shard."""
        self.read_scatter(shard_id, offset, [buffer])

    def read_scatter(self, shard_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in turn from one byte range of a shard, received straight into them.

        Network errors and 429/5xx answers are retried (a read is safe to repeat).

        Raises:
            IntegrityError: the server ignored the range or sent too few or too many bytes.
        """
        length = sum(buffer.nbytes for buffer in buffers)
        if length == 0 or self.direct_reads.read(shard_id, offset, buffers):
            return
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        answer = self.session.get_into(f"/v1/shards/{shard_id}", headers, buffers, f"reading shard {shard_id}")
        if answer.status_code != 206:
            raise IntegrityError(f"the server ignored the byte range for shard {shard_id} (HTTP {answer.status_code})")

    def read_ranges(self, ranges: Sequence[tuple[str, int, Sequence[memoryview]]]) -> None:
        """Fill, for each ``(shard_id, offset, buffers)``, ``buffers`` in turn from that shard's
        bytes at ``offset``: every range in one request (``POST /v1/shards/ranges``), its answer
        received straight into the buffers.

        Network errors and 429/5xx answers are retried (a read is safe to repeat).

        Raises:
            IntegrityError: the server sent too few or too many bytes.
        """
        if self.direct_reads.offered:  # the large ranges straight from the blob store, the rest in one request
            ranges = [
                (shard_id, offset, buffers)
                for shard_id, offset, buffers in ranges
                if sum(b.nbytes for b in buffers) < DIRECT_MIN_BYTES
                or not self.direct_reads.read(shard_id, offset, buffers)
            ]
            if not ranges:
                return
        wanted = [
            {"shard_id": shard_id, "offset": offset, "length": sum(b.nbytes for b in buffers)}
            for shard_id, offset, buffers in ranges
        ]
        body = json.dumps({"ranges": wanted}).encode()
        headers = {"Content-Type": "application/json"}
        flat = [buffer for _, _, buffers in ranges for buffer in buffers]
        try:
            self.session.post_into("/v1/shards/ranges", body, headers, flat, f"reading {len(wanted)} shard ranges")
        except RangeNotSatisfiableError as exc:  # the version's locations say the bytes are there
            raise IntegrityError(f"a stored shard is shorter than recorded: {exc.message}") from exc

    def runs(self) -> list[RunInfo]:
        """Every run."""
        return [RunInfo.model_validate(item) for item in self._json("GET", "/v1/runs", metadata=True)]

    def versions(self, run_id: str) -> list[VersionInfo]:
        """Every version of a run."""
        data = self._json("GET", f"/v1/runs/{quote(validate_run_id(run_id))}/versions", metadata=True)
        return [VersionInfo.model_validate(item) for item in data]

    def tag(self, run_id: str, ref: int | str, name: str) -> int:
        """Point a tag at a version."""
        path = f"/v1/runs/{quote(validate_run_id(run_id))}/tags/{quote(name, safe='')}"
        return int(self._json("PUT", path, json={"version": ref}, metadata=True)["version"])

    def untag(self, run_id: str, name: str) -> None:
        """Remove a tag."""
        self._json("DELETE", f"/v1/runs/{quote(validate_run_id(run_id))}/tags/{quote(name, safe='')}", metadata=True)

    def delete_version(self, run_id: str, ref: int | str) -> int:
        """Delete a version."""
        path = f"/v1/runs/{quote(validate_run_id(run_id))}/versions/{_ref(ref)}"
        return int(self._json("DELETE", path, metadata=True)["version"])

    def get_retention(self, run_id: str) -> RetentionPolicy:
        """A run's retention policy and what it would remove now."""
        data = self._json("GET", f"/v1/runs/{quote(validate_run_id(run_id))}/retention", metadata=True)
        return RetentionPolicy.model_validate(data)

    def set_retention(
        self,
        run_id: str,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str | None = None,
        create_run: bool = False,
    ) -> RetentionPolicy:
        """Replace a run's retention policy (a PUT: safe to retry)."""
        policy = {"keep_last": keep_last, "keep_best": keep_best, "metric": metric, "mode": mode}
        path = f"/v1/runs/{quote(validate_run_id(run_id))}/retention" + ("?create=true" if create_run else "")
        data = self._json("PUT", path, json=policy)
        return RetentionPolicy.model_validate(data)

    def apply_retention(self, run_id: str) -> list[int]:
        """Remove now what a run's policy does not keep (safe to retry: a second pass removes nothing)."""
        data = self._json("POST", f"/v1/runs/{quote(validate_run_id(run_id))}/retention/apply")
        return [int(v) for v in data["removed"]]

    def gc(
        self,
        *,
        grace_seconds: int | None = None,
        dry_run: bool = False,
        orphans: bool = False,
        compact_below: float | None = None,
        compress: bool = False,
        on_bytes: Callable[[int], object] | None = None,
    ) -> GcReport:
        """Garbage-collect on the server (admin scope; safe to retry: a second pass sweeps nothing new).
        The server does the work: ``on_bytes`` is never called."""
        payload = {
            "dry_run": dry_run,
            "grace_seconds": grace_seconds,
            "orphans": orphans,
            "compact_below": compact_below,
            "compress": compress,
        }
        return GcReport.model_validate(self._json("POST", "/v1/gc", json=payload))

    def close(self) -> None:
        """Close connections."""
        self.direct_reads.close()
        self.session.close()


__all__ = ["HttpTransport", "remove_stale_staging"]
