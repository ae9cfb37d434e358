"""Removing temporary files that processes killed mid-save left behind.

A shard is written or received under a temporary ``*.incomplete`` name and only ever
renamed into the blob store once complete and verified, so a killed client or server leaves
at most such files, never a half blob. They live in two places:

- the store's ``staging_dir``: shards an embedded client was writing, or a server was receiving or
  verifying;
- a :class:`~service.blobs.LocalBlobStore`'s ``.incoming`` folder: copies into a blob folder on
  another file system.

Nothing references them. Each one's writer holds a lock on it for as long as it writes it
(:mod:`service.blobs.held_file`), and the kernel drops that lock when the writer dies, so a file
nobody holds is a leftover whatever its age, and one somebody holds is never touched, however
old. Only on a file system that cannot lock is a file judged by its age instead: removed once
untouched for ``older_than_seconds`` (an active writer keeps the file's mtime fresh).

Three callers sweep: ``ckptstore gc --orphans`` (:meth:`Store.gc`), a server's start, and the
opening of an embedded store, which looks at a bounded number of files (:data:`OPEN_SWEEP_FILES`)
and never waits for a writer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckptstore.service.blobs import BlobStore, LocalBlobStore
from ckptstore.service.blobs.held_file import TEMP_SUFFIX, Verdict, sweep_file
from ckptstore.service.format.records import GcReport

#: The age after which a temporary file the lock cannot judge is taken to be abandoned.
STALE_SECONDS = 3600.0
#: Temporary files an embedded store's opening looks at, at most: the rest wait for the next
#: opening or ``ckptstore gc --orphans``.
OPEN_SWEEP_FILES = 256
#: LocalBlobStore's folder for copies arriving from another file system.
INCOMING_DIR = ".incoming"


class Staged(Protocol):
    """What cleaning needs of a store: its staging folder and its blob store.

    :class:`service.store.Store` has both; this module asks for no more, so the store can call
    it without the two importing each other.
    """

    @property
    def staging_dir(self) -> Path: ...

    @property
    def blobs(self) -> BlobStore: ...


@dataclass(frozen=True)
class CleanupReport:
    """What :func:`clean_staging` did (on a dry run, would do).

    Attributes:
        removed: temporary files deleted: no live process held them.
        bytes_removed: their total size.
        in_use: temporary files a live process holds (being written, received or verified).
        kept: files the lock could not judge, younger than the threshold (possibly still being written).
        failed: files that could not be deleted (e.g. permissions); left in place.
    """

    removed: int = 0
    bytes_removed: int = 0
    kept: int = 0
    failed: int = 0
    in_use: int = 0


def temp_folders(store: Staged) -> list[Path]:
    """The folders where ``store`` keeps temporary files."""
    folders = [store.staging_dir]
    if isinstance(store.blobs, LocalBlobStore):
        folders.append(store.blobs.root / INCOMING_DIR)
    return folders


def _temp_files(folders: Iterable[Path]) -> Iterable[os.DirEntry[str]]:
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:  # absent or unreadable: nothing to sweep there
            continue
        for entry in entries:
            # Only our own temporary names, only plain files: a symlink is never followed.
            if entry.name.endswith(TEMP_SUFFIX) and entry.is_file(follow_symlinks=False):
                yield entry


def clean_staging(
    store: Staged,
    older_than_seconds: float = STALE_SECONDS,
    now: float | None = None,
    *,
    dry_run: bool = False,
    limit: int | None = None,
) -> CleanupReport:
    """Delete the ``*.incomplete`` files in ``store``'s temporary folders that no live process holds.

    Safe while the store serves requests and saves run: a file being written, received or
    verified is held by its writer and kept; files that vanish meanwhile (a writer finishing)
    are skipped. Never waits for a writer.

    Args:
        store: the store to clean.
        older_than_seconds: where the file system cannot lock, the minimum age (since last
            modification) of a file to delete; 0 deletes every such file.
        now: the current time as a Unix timestamp (default: the clock).
        dry_run: count what would be deleted, delete nothing.
        limit: look at this many temporary files at most (None: all).
    """
    if older_than_seconds < 0:
        raise ValueError(f"older_than_seconds must be >= 0, not {older_than_seconds}")
    now = time.time() if now is None else now
    removed = bytes_removed = kept = failed = in_use = 0
    for number, entry in enumerate(_temp_files(temp_folders(store))):
        if limit is not None and number >= limit:
            break
        try:
            verdict, size = sweep_file(entry.path, remove=not dry_run)
            if verdict is Verdict.UNJUDGED:
                verdict, size = _judge_by_age(entry, older_than_seconds, now, dry_run)
        except OSError:
            failed += 1
            continue
        if verdict is Verdict.REMOVED:
            removed += 1
            bytes_removed += size
        elif verdict is Verdict.IN_USE:
            in_use += 1
        elif verdict is Verdict.UNJUDGED:
            kept += 1
    return CleanupReport(removed=removed, bytes_removed=bytes_removed, kept=kept, failed=failed, in_use=in_use)


def _judge_by_age(entry: os.DirEntry[str], older_than_seconds: float, now: float, dry_run: bool) -> tuple[Verdict, int]:
    """A file the lock cannot judge: removed once untouched for ``older_than_seconds``, else kept (UNJUDGED)."""
    try:
        stat = os.stat(entry.path, follow_symlinks=False)
        if older_than_seconds > 0 and now - stat.st_mtime < older_than_seconds:
            return Verdict.UNJUDGED, stat.st_size
        if not dry_run:
            os.unlink(entry.path)
    except FileNotFoundError:
        return Verdict.GONE, 0
    return Verdict.REMOVED, stat.st_size


def with_staging_swept(report: GcReport, swept: CleanupReport | None) -> GcReport:
    """``report`` with what a sweep of the temporary folders removed (or, on a dry run, would)."""
    if swept is None:
        return report
    return report.model_copy(update={"staging_files_swept": swept.removed, "staging_bytes_swept": swept.bytes_removed})


__all__ = [
    "OPEN_SWEEP_FILES",
    "STALE_SECONDS",
    "CleanupReport",
    "Staged",
    "clean_staging",
    "temp_folders",
    "with_staging_swept",
]
