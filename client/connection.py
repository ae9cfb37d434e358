"""A torch-free handle on one store: browse runs and versions, tag, delete, collect, keep.

:class:`client.api.Client` adds saving and loading on top. Everything here works on names,
numbers and JSON records only, so the command line's listing and management commands (and
any tool that only looks at a store) start without importing torch.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ckptstore.service.catalog.retention_rules import Policy, check_policy
from ckptstore.service.errors import InvalidInputError, NotFoundError, PermissionDeniedError
from ckptstore.service.format.records import GcReport, RetentionPolicy, RunInfo, VersionInfo

if TYPE_CHECKING:
    from ckptstore.client.store_protocol import Transport

DEFAULT_HOME = "~/.ckptstore"

#: What gives the process's default client: ``client.default_client``, put here when the
#: ``client`` package is imported (which every import of a ``client.*`` module does first).
#: The packages below the Client (the sharded path) reach it through here, never importing it.
_default_client: Callable[[], Connection] | None = None


def provide_default_client(factory: Callable[[], Connection]) -> None:
    """Name the function that gives the process's default client (called by ``client`` itself)."""
    global _default_client
    _default_client = factory


def default_connection() -> Connection:
    """The process's default client, from the environment (see :func:`client.default_client`)."""
    if _default_client is None:  # only a module loaded outside its package gets here
        raise RuntimeError("no default client is provided: import ckptstore.client first")
    return _default_client()


def default_home() -> Path:
    """``$CKPTSTORE_HOME`` or ``~/.ckptstore``, read now."""
    return Path(os.environ.get("CKPTSTORE_HOME") or DEFAULT_HOME).expanduser()


def open_transport(
    url: str | None,
    home: Path | str | None,
    token: str | None,
    *,
    create: bool = True,
    retry_seconds: float | None = None,
) -> Transport:
    """A server at ``url``; else the embedded store in ``home``; else the store the environment
    names, as ``ckptstore serve`` reads it (``CKPTSTORE_DATABASE_URL``, ``CKPTSTORE_BLOBS``,
    ``CKPTSTORE_HOME``; see :func:`service.settings.local_settings`).

    With ``create=False`` a store that does not exist yet is refused (NotFoundError naming
    the variables to set) rather than created.
    """
    # Imported here, not at the top: a client over HTTP never pays for the engine (SQLAlchemy,
    # Alembic), an embedded one never for httpx. Some of what they import draws from Python's
    # global ``random`` as it loads (rich, under httpx); a training job that opens its first client
    # at its first save must not see its random stream moved by it, so that state is kept.
    kept = random.getstate()
    try:
        return _open_transport(url, home, token, create=create, retry_seconds=retry_seconds)
    finally:
        random.setstate(kept)


def _open_transport(
    url: str | None, home: Path | str | None, token: str | None, *, create: bool, retry_seconds: float | None
) -> Transport:
    """:func:`open_transport`, without keeping Python's random state."""
    if url:
        if not url.startswith(("http://", "https://")):
            raise InvalidInputError(f"CKPTSTORE_URL must start with http:// or https://, not {url[:80]!r}")
        from ckptstore.client.http.transport import HttpTransport

        return HttpTransport(url, token, retry_seconds=retry_seconds)
    from ckptstore.service.factory import open_store
    from ckptstore.service.reclaim.cleanup import OPEN_SWEEP_FILES, clean_staging
    from ckptstore.service.settings import local_settings

    store = open_store(local_settings(home), require_current_schema=True, create=create)
    # What saves killed mid-write left in the staging folder: files no live process holds (a
    # bounded look that never waits for a writer).
    clean_staging(store, limit=OPEN_SWEEP_FILES)
    return store


class Connection:
    """One store, for everything but tensors: runs, versions, tags, deletion, gc and retention.

    Args are as for :class:`client.api.Client`, which is a Connection that also saves and loads.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        home: Path | str | None = None,
        token: str | None = None,
        retry_seconds: float | None = None,
        create: bool = True,
    ) -> None:
        self.transport = open_transport(url, home, token, create=create, retry_seconds=retry_seconds)

    def close(self) -> None:
        """Release the store's resources."""
        self._settle()
        self.transport.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settle(self) -> None:
        """Called before every operation: a client saving in the background waits for it here."""

    def _history_changed(self) -> None:
        """Called before versions are removed: a client forgets what it knew was committed."""

    # -- browsing ------------------------------------------------------------------------

    def runs(self) -> list[RunInfo]:
        """Every run in the store, most recently updated first."""
        self._settle()
        return self.transport.runs()

    def versions(self, run_id: str) -> list[VersionInfo]:
        """Every version of ``run_id``, oldest first."""
        self._settle()
        return self.transport.versions(run_id)

    def tag(self, run_id: str, version: int | str, name: str) -> int:
        """Point tag ``name`` at a version; returns the version number."""
        self._settle()
        return self.transport.tag(run_id, version, name)

    def untag(self, run_id: str, name: str) -> None:
        """Remove a tag."""
        self._settle()
        self.transport.untag(run_id, name)

    def delete(self, run_id: str, version: int | str) -> int:
        """Delete one version; returns its number. Stored bytes are reclaimed by garbage collection."""
        self._settle()
        self._history_changed()
        return self.transport.delete_version(run_id, version)

    def gc(
        self,
        *,
        grace_seconds: int | None = None,
        dry_run: bool = False,
        orphans: bool = False,
        compact_below: float | None = None,
        compress: bool = False,
    ) -> GcReport:
        """Delete the stored bytes no version references any more; returns what went (or would go).

        Shards recorded, or reported present to a save, less than ``grace_seconds`` ago (default
        one hour) are kept, so saves in progress are never affected. ``dry_run`` only reports.
        ``orphans`` also deletes blobs no shard record names (left by an interrupted collection);
        run that while no save is uploading. ``compact_below`` (a fraction, e.g. 0.5) first
        rewrites the live tensors of every shard whose live bytes are below that share of its
        size into a new shard; the old shard goes once the grace period has passed. ``compress``
        first re-encodes, smallest first, the tensors each version older than the grace period
        added: byte-grouped and compressed, or as a compressed delta against the same tensor
        of an earlier version stored whole (its keyframe); loads decode them, and the raw shards
        go once the grace period has passed; on a terminal a bar counts the bytes visited, out
        of a total counted first, with the time left (a server's collection shows none). A
        server asks for an admin token.
        """
        from ckptstore.client.progress import byte_bar, counter  # here: only a compressing collection shows a bar

        self._settle()
        here = compress and not getattr(self.transport, "remote", False)
        with byte_bar(0, "compress") if here else contextlib.nullcontext() as bar:
            return self.transport.gc(
                grace_seconds=grace_seconds,
                dry_run=dry_run,
                orphans=orphans,
                compact_below=compact_below,
                compress=compress,
                on_bytes=counter(bar) if bar is not None else None,
            )

    # -- retention -----------------------------------------------------------------------

    def retention(self, run_id: str) -> RetentionPolicy:
        """The run's retention policy and, in ``would_remove``, the versions it would remove now."""
        self._settle()
        return self.transport.get_retention(run_id)

    def set_retention(
        self,
        run_id: str,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        *,
        create_run: bool = False,
    ) -> RetentionPolicy:
        """Replace the run's retention policy; each commit from the next one on applies it.

        Kept are the last ``keep_last`` versions, the ``keep_best`` best by ``metric`` ('min':
        lowest is best; 'max': highest; ties go to the newer version), every tagged version and
        the newest one; the others are removed at the next commit (or at once with
        :meth:`apply_retention`). Neither ``keep_last`` nor ``keep_best`` clears the policy. A
        run that does not exist yet is NotFoundError, or created with ``create_run`` (so a policy
        can precede the first save; :meth:`client.api.Client.save` with a policy does this). A
        server asks for an admin token: a policy deletes versions.
        """
        self._settle()
        try:
            return self.transport.set_retention(
                run_id,
                keep_last=keep_last,
                keep_best=keep_best,
                metric=metric,
                mode=mode if keep_best is not None else None,
                create_run=create_run,
            )
        except PermissionDeniedError as exc:
            raise PermissionDeniedError(
                f"{exc.message}: a retention policy deletes versions, so setting one needs an admin token "
                f"(an admin can run `ckptstore retention {run_id} ...`; saves with a write token then keep to it)"
            ) from exc

    def apply_retention(self, run_id: str) -> list[int]:
        """Remove now the versions the run's policy does not keep; returns their numbers."""
        self._settle()
        self._history_changed()
        return self.transport.apply_retention(run_id)

    def _use_retention(
        self, run_id: str, keep_last: int | None, keep_best: int | None, metric: str | None, mode: str | None
    ) -> None:
        """Make the run's policy the one given, writing it only when it differs.

        Reading first lets a training job with a write token save with the policy an admin set.
        """
        wanted = check_policy(keep_last, keep_best, metric, mode)
        try:
            current = self.transport.get_retention(run_id)
        except NotFoundError:  # a new run
            current = None
        if current is None or Policy(current.keep_last, current.keep_best, current.metric, current.mode) != wanted:
            chosen: Literal["min", "max"] = "max" if wanted.mode == "max" else "min"
            # A new run: this save creates it anyway, so the policy may create it first.
            self.set_retention(
                run_id, wanted.keep_last, wanted.keep_best, wanted.metric, chosen, create_run=current is None
            )
