"""The client's HTTP transport: the same operations as the embedded store, over the v1 API.

Connections are pooled; shard uploads stream from disk; reads ask for byte ranges.
Connection errors and 429/5xx answers are retried with exponential backoff and jitter (at most
:data:`MAX_PAUSE_SECONDS` a pause) for up to the retry budget (``retry_seconds``,
``CKPTSTORE_RETRY_SECONDS``, default :data:`DEFAULT_RETRY_SECONDS`: long enough to ride out
a server restart), but only for requests that are safe to repeat. A commit is sent again only
when the connection was refused or never opened (the server cannot have seen it); after any
other failure its outcome is unknown, so it is not retried. Error responses carry
``X-Error-Code``; :func:`raise_for_error` turns them back into the same exception classes the
embedded store raises.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit
from urllib.request import getproxies

import httpx

from client.bulk_http import BULK_NETWORK_ERRORS, BulkHttp, BulkResponse
from service import __version__
from service.errors import (
    CheckpointError,
    IntegrityError,
    InvalidInputError,
    MissingTensorsError,
    StateMismatchError,
    StorageError,
    error_class_for_code,
)
from service.format.digest import shard_id as digest_shard_id
from service.format.manifest import Manifest, ManifestBody, manifest_from_json
from service.format.names import validate_run_id
from service.format.safetensors_header import read_header
from service.records import GcReport, RetentionPolicy, RunInfo, ShardReceipt, TensorLocation, VersionInfo
from service.shard_writer import UnhashedTensor

RETRY_STATUSES = {429, 500, 502, 503, 504}
NETWORK_ERRORS = (httpx.TransportError,)
#: Failures before the request left this process: even a commit is safe to send again.
NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
#: How long requests safe to repeat are retried, by default: a server restart takes up to ~30 s.
DEFAULT_RETRY_SECONDS = 60.0
RETRY_SECONDS_VARIABLE = "CKPTSTORE_RETRY_SECONDS"
#: The longest pause between two tries of a request.
MAX_PAUSE_SECONDS = 4.0
log = logging.getLogger("ckptstore.client")
#: Upload staging folders are ``<tmp>/ckptstore-upload-<pid>-<random>``.
STAGING_PREFIX = "ckptstore-upload-"
#: A staging folder untouched this long whose process is gone was left by a killed client.
STALE_STAGING_SECONDS = 3600.0


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


def needs_tls_context(url: str) -> bool:
    """Whether a client for ``url`` must build a TLS context: not for a plain ``http://`` server
    reached without a proxy, where building one (loading the CA bundle) took 35-95 ms of every
    client's start and would never be used. Any proxy in the environment keeps it, as the
    proxy itself may be reached over TLS."""
    return urlsplit(url).scheme != "http" or bool(getproxies())


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


def raise_for_error(response: httpx.Response) -> None:
    """Raise the CheckpointError an error response stands for; return on success."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
        code, message = str(body.get("code", "")), str(body.get("message", ""))
    except ValueError:
        body, code, message = {}, "", response.text[:500]
    code = code or response.headers.get("x-error-code", "")
    cls = error_class_for_code(code)
    text = message or f"HTTP {response.status_code} from {response.request.url}"
    if issubclass(cls, MissingTensorsError):
        raise cls(text, body.get("digests") or [])
    if issubclass(cls, StateMismatchError):
        raise cls(text)
    if cls is CheckpointError:
        fallback = StorageError if response.status_code >= 500 else CheckpointError
        raise fallback(f"HTTP {response.status_code}: {message}" if message else text)
    raise cls(text)


def raise_for_bulk_error(answer: BulkResponse, url: str) -> None:
    """Raise the CheckpointError a bulk (shard bytes) answer stands for; return on success."""
    if answer.status < 400:
        return
    request = httpx.Request("GET", url)
    raise_for_error(httpx.Response(answer.status, headers=answer.headers, content=answer.body, request=request))


def _ref(ref: int | str) -> str:
    return quote(str(ref), safe="")


class HttpTransport:
    """Talks to a ckptstore server at ``url`` (``http://host:port``)."""

    #: A shard's upload URL names its id, so every tensor is hashed before it is sent.
    takes_unhashed = False

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        retry_seconds: float | None = None,
        retries: int | None = None,
        backoff_seconds: float = 0.25,
        timeout_seconds: float = 300.0,
        http: httpx.Client | None = None,
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
            http: an httpx client to use (tests).
        """
        headers = {"User-Agent": f"ckptstore/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.url = url.rstrip("/")
        self.retry_seconds = retry_budget(retry_seconds)
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self._http = http or httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout_seconds, connect=10.0),
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=16),
            verify=needs_tls_context(self.url),
        )
        if http is not None:
            self._http.headers.update(headers)
        # Shard bytes bypass httpx: sent from and received into tensor memory directly.
        self._bulk = BulkHttp(self.url, headers, timeout_seconds)
        # A client killed mid-save cannot remove its folder; the next one to start does.
        remove_stale_staging()
        self._staging: Path | None = None  # made on first use: saves stream from memory and need none

    # -- plumbing ------------------------------------------------------------------------

    def _send(self, idempotent: bool, build: Callable[[], httpx.Response]) -> httpx.Response:
        started, attempt = time.monotonic(), 0
        while True:
            try:
                response = build()
            except NETWORK_ERRORS as exc:
                # A refused connection never reached the server: even a commit may go again.
                safe = idempotent or isinstance(exc, NOT_SENT_ERRORS)
                if safe and self._retry(attempt, started, exc):
                    attempt += 1
                    continue
                what = "" if safe else " (a commit is not retried: list the versions to see if it landed)"
                raise StorageError(self._unreachable(exc, attempt, started) + what) from exc
            if response.status_code in RETRY_STATUSES and idempotent:
                retry_after = response.headers.get("retry-after")
                if self._retry(attempt, started, f"HTTP {response.status_code}", retry_after):
                    response.close()
                    attempt += 1
                    continue
            return response

    def _retry(self, attempt: int, started: float, cause: object, retry_after: str | None = None) -> bool:
        """Pause before try ``attempt + 2`` of a request begun at ``started``; False once the
        retry budget (or the count of retries) is spent."""
        left = self.retry_seconds - (time.monotonic() - started)
        if left <= 0 or (self.retries is not None and attempt >= self.retries):
            return False
        delay = min(MAX_PAUSE_SECONDS, self.backoff_seconds * 2**attempt) * (0.5 + random.random() / 2)
        if retry_after is not None and retry_after.isdigit():
            delay = max(delay, min(float(retry_after), 30.0))
        delay = min(delay, left)
        # The first failure of a request is worth a warning: the call may now wait a while.
        log.log(
            logging.WARNING if attempt == 0 else logging.INFO,
            "ckptstore server at %s: %s; retrying in %.1f s (giving up after %.0f s; %s sets how long)",
            self.url,
            cause,
            delay,
            self.retry_seconds,
            RETRY_SECONDS_VARIABLE,
        )
        time.sleep(delay)
        return True

    def _unreachable(self, exc: BaseException, attempt: int, started: float) -> str:
        """The message for a server that could not be reached: where, why, and what to check."""
        return (
            f"cannot reach the ckptstore server at {self.url}: {exc}. Is the server running at {self.url}? "
            f"Check CKPTSTORE_URL (gave up after {attempt + 1} tries in {time.monotonic() - started:.1f} s; "
            f"{RETRY_SECONDS_VARIABLE} sets how long to keep trying)"
        )

    def _json(self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any) -> Any:
        response = self._send(idempotent, lambda: self._http.request(method, path, **kwargs))
        raise_for_error(response)
        return response.json() if response.content else None

    # -- the Transport protocol ----------------------------------------------------------

    def missing(self, digests: Iterable[str]) -> list[str]:
        """Digests the server lacks."""
        wanted = list(dict.fromkeys(digests))
        if not wanted:
            return []
        return list(self._json("POST", "/v1/tensors/missing", json={"digests": wanted})["missing"])

    def staging_path(self) -> Path:
        """A local temporary path for the next shard."""
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
        return self._staging / f"{uuid.uuid4().hex}.shard"

    def ingest_file(self, path: Path) -> ShardReceipt:
        """Upload the shard file at ``path`` (mapped, sent like :meth:`put_shard`) and delete the file."""
        path = Path(path)
        try:
            with open(path, "rb") as handle:
                header = read_header(handle, os.fstat(handle.fileno()).st_size)
                if header.data_length == 0:
                    return self.put_shard(header.header_bytes, [])
                with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    data = memoryview(mapped)
                    tensors = data[header.data_start :]
                    try:
                        return self.put_shard(header.header_bytes, [tensors])
                    finally:  # no view may outlive the mapping, even one held by a traceback
                        tensors.release()
                        data.release()
        finally:
            path.unlink(missing_ok=True)

    def put_tensors(
        self, tensors: Sequence[UnhashedTensor], on_bytes: Callable[[int], object] | None = None
    ) -> tuple[ShardReceipt, list[str]]:
        """Not available over HTTP (see :attr:`takes_unhashed`)."""
        raise NotImplementedError("a server takes only shards of hashed tensors")

    def put_shard(
        self,
        header: bytes,
        pieces: Sequence[memoryview],
        on_bytes: Callable[[int], object] | None = None,
    ) -> ShardReceipt:
        """Upload a shard straight from memory: its header bytes, then its tensors' bytes.

        The server checks the id and hashes every tensor as the body arrives. Retried on
        network errors and 429/5xx answers (an upload is idempotent).
        """
        shard_id = digest_shard_id(header)
        body = [memoryview(header), *pieces]
        headers = {"Content-Type": "application/octet-stream"}
        path = f"/v1/shards/{shard_id}"
        answer = self._bulk_retried(f"uploading shard {shard_id}", path, lambda: self._bulk.put(path, body, headers))
        if on_bytes is not None:
            on_bytes(sum(piece.nbytes for piece in pieces))
        return ShardReceipt.model_validate_json(answer.body)

    def _bulk_retried(self, what: str, path: str, request: Callable[[], BulkResponse]) -> BulkResponse:
        """Run a bulk request, retrying network errors and 429/5xx answers (bulk requests are idempotent).

        Raises the CheckpointError an error answer stands for, or StorageError once retries run out.
        """
        started, attempt = time.monotonic(), 0
        while True:
            try:
                answer = request()
            except BULK_NETWORK_ERRORS as exc:
                if self._retry(attempt, started, exc):
                    attempt += 1
                    continue
                raise StorageError(f"{what} failed: " + self._unreachable(exc, attempt, started)) from exc
            if answer.status in RETRY_STATUSES and self._retry(
                attempt, started, f"HTTP {answer.status}", answer.headers.get("retry-after")
            ):
                attempt += 1
                continue
            raise_for_bulk_error(answer, f"{self.url}{path}")
            return answer

    def commit(self, run_id: str, body: ManifestBody, *, tags: Sequence[str] = ()) -> VersionInfo:
        """Commit a version (never retried: its outcome would be ambiguous)."""
        payload = '{"manifest":' + body.model_dump_json() + ',"tags":' + json.dumps(list(tags)) + "}"
        data = self._json(
            "POST",
            f"/v1/runs/{quote(validate_run_id(run_id))}/versions",
            idempotent=False,
            content=payload.encode(),
            headers={"Content-Type": "application/json"},
        )
        return VersionInfo.model_validate(data)

    def resolve(self, run_id: str, ref: int | str = "latest") -> int:
        """The version number ``ref`` names."""
        data = self._json("GET", f"/v1/runs/{quote(validate_run_id(run_id))}/refs/{_ref(ref)}")
        return int(data["version"])

    def manifest(self, run_id: str, ref: int | str = "latest") -> Manifest:
        """A version's manifest."""
        response = self._send(
            True, lambda: self._http.get(f"/v1/runs/{quote(validate_run_id(run_id))}/versions/{_ref(ref)}")
        )
        raise_for_error(response)
        return manifest_from_json(response.content)

    def locate(self, digests: Iterable[str]) -> dict[str, TensorLocation]:
        """Where each digest's bytes live."""
        wanted = list(dict.fromkeys(digests))
        if not wanted:
            return {}
        data = self._json("POST", "/v1/tensors/locate", json={"digests": wanted})
        return {digest: TensorLocation.model_validate(item) for digest, item in data.items()}

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
        if length == 0:
            return
        path = f"/v1/shards/{shard_id}"
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        answer = self._bulk_retried(
            f"reading shard {shard_id}", path, lambda: self._bulk.get_into(path, headers, buffers)
        )
        if answer.status != 206:
            raise IntegrityError(f"the server ignored the byte range for shard {shard_id} (HTTP {answer.status})")

    def runs(self) -> list[RunInfo]:
        """Every run."""
        return [RunInfo.model_validate(item) for item in self._json("GET", "/v1/runs")]

    def versions(self, run_id: str) -> list[VersionInfo]:
        """Every version of a run."""
        data = self._json("GET", f"/v1/runs/{quote(validate_run_id(run_id))}/versions")
        return [VersionInfo.model_validate(item) for item in data]

    def tag(self, run_id: str, ref: int | str, name: str) -> int:
        """Point a tag at a version."""
        path = f"/v1/runs/{quote(validate_run_id(run_id))}/tags/{quote(name, safe='')}"
        return int(self._json("PUT", path, json={"version": ref})["version"])

    def untag(self, run_id: str, name: str) -> None:
        """Remove a tag."""
        self._json("DELETE", f"/v1/runs/{quote(validate_run_id(run_id))}/tags/{quote(name, safe='')}")

    def delete_version(self, run_id: str, ref: int | str) -> int:
        """Delete a version."""
        path = f"/v1/runs/{quote(validate_run_id(run_id))}/versions/{_ref(ref)}"
        return int(self._json("DELETE", path)["version"])

    def get_retention(self, run_id: str) -> RetentionPolicy:
        """A run's retention policy and what it would remove now."""
        data = self._json("GET", f"/v1/runs/{quote(validate_run_id(run_id))}/retention")
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

    def gc(self, *, grace_seconds: int | None = None, dry_run: bool = False, orphans: bool = False) -> GcReport:
        """Garbage-collect on the server (admin scope; safe to retry: a second pass sweeps nothing new)."""
        payload = {"dry_run": dry_run, "grace_seconds": grace_seconds, "orphans": orphans}
        return GcReport.model_validate(self._json("POST", "/v1/gc", json=payload))

    def close(self) -> None:
        """Close connections and remove the upload staging folder."""
        self._http.close()
        self._bulk.close()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)


__all__ = ["HttpTransport", "raise_for_error", "remove_stale_staging"]
