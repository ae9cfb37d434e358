"""Removing temporary files that processes killed mid-save left behind.

A shard is written or received under a temporary ``*.incomplete`` name and only ever
renamed into the blob store once complete and verified, so a killed client or server leaves
at most such files, never a half blob. They live in two places:

- the store's ``staging_dir``: shards an embedded client was writing, or a server was receiving or
  verifying;
- a :class:`~service.blobs.LocalBlobStore`'s ``.incoming`` folder: copies into a blob folder on
  another file system.

Nothing references them, but a live writer may still be using one, so only files untouched
for ``older_than_seconds`` are removed (an active writer keeps the file's mtime fresh).
Pass 0 only when no save is running against the store.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckptstore.service.blobs import BlobStore, LocalBlobStore

#: The age after which a temporary file is taken to be abandoned.
STALE_SECONDS = 3600.0
TEMP_SUFFIX = ".incomplete"
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
    """What :func:`clean_staging` did.

    Attributes:
        removed: temporary files deleted.
        bytes_removed: their total size.
        kept: temporary files younger than the threshold (possibly still being written).
        failed: files that could not be deleted (e.g. permissions); left in place.
    """

    removed: int = 0
    bytes_removed: int = 0
    kept: int = 0
    failed: int = 0


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
        except FileNotFoundError:
            continue
        for entry in entries:
            # Only our own temporary names, only plain files: a symlink is never followed.
            if entry.name.endswith(TEMP_SUFFIX) and entry.is_file(follow_symlinks=False):
                yield entry


def clean_staging(store: Staged, older_than_seconds: float = STALE_SECONDS, now: float | None = None) -> CleanupReport:
    """Delete ``*.incomplete`` files in ``store``'s temporary folders not modified for ``older_than_seconds``.

    Safe while the store serves requests as long as the threshold exceeds the longest pause in
    writing one shard (the default, an hour, does); files that vanish meanwhile (a writer
    finishing) are skipped.

    Args:
        store: the store to clean.
        older_than_seconds: minimum age (since last modification) of a file to delete;
            0 deletes every temporary file.
        now: the current time as a Unix timestamp (default: the clock).
    """
    if older_than_seconds < 0:
        raise ValueError(f"older_than_seconds must be >= 0, not {older_than_seconds}")
    now = time.time() if now is None else now
    removed = bytes_removed = kept = failed = 0
    for entry in _temp_files(temp_folders(store)):
        try:
            stat = entry.stat(follow_symlinks=False)
            if older_than_seconds > 0 and now - stat.st_mtime < older_than_seconds:
                kept += 1
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError:
            failed += 1
            continue
        removed += 1
        bytes_removed += stat.st_size
    return CleanupReport(removed=removed, bytes_removed=bytes_removed, kept=kept, failed=failed)


__all__ = ["STALE_SECONDS", "CleanupReport", "Staged", "clean_staging", "temp_folders"]
