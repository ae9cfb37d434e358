"""The phase protocol: a process under test announces where it is and may wait to be let on.

A line ``phase <name>`` on stdout says the process is about to do ``<name>``. When it runs
with waiting on, it then blocks until the driver sends a line ``go`` on stdin, so the driver
can SIGKILL it at exactly that point (or let it go and kill it a moment later). Output goes
through ``os.write`` and input through ``os.read`` one byte at a time: nothing is buffered, so
a forked process never inherits half-read input or unflushed output.

:func:`install_store_hooks` wraps the engine's write path (class and module attributes only,
no product file changes) so the same phases come from an embedded client and from a server.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import ckptstore.service.catalog.commit  # noqa: F401  (binds service.catalog.commit for the name below)
import ckptstore.service.intake.ingest  # noqa: F401  (binds service.intake.ingest for the name below)
from ckptstore import service
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.intake.receiver import ShardReceiver
from ckptstore.service.store import Store

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux).

    So no server or victim outlives a driver that was itself killed.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def say(line: str) -> None:
    """Write one line to stdout at once (no Python buffering)."""
    data = (line + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def read_line() -> str | None:
    """One line from stdin, read unbuffered; None at end of input."""
    chunks = bytearray()
    while True:
        byte = os.read(0, 1)
        if not byte:
            return None if not chunks else chunks.decode()
        if byte == b"\n":
            return chunks.decode()
        chunks += byte


class Phases:
    """Announces phases; with ``wait``, blocks after each until the driver answers ``go``."""

    def __init__(self, wait: bool) -> None:
        self.wait = wait
        # One phase at a time: upload threads and the main thread share stdin.
        self._lock = threading.RLock()

    def __call__(self, name: str) -> None:
        with self._lock:
            say(f"phase {name}")
            if self.wait:
                answer = read_line()
                if answer != "go":
                    say(f"error ProtocolError expected 'go', got {answer!r}")
                    os._exit(70)


def _before(phases: Phases, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        phases(name)
        return function(*args, **kwargs)

    return wrapper


def _around(phases: Phases, before: str, after: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        phases(before)
        result = function(*args, **kwargs)
        phases(after)
        return result

    return wrapper


def install_store_hooks(phases: Phases, *, entry_points: bool) -> None:
    """Announce the engine's write steps.

    Inside :meth:`Store.ingest_file` and :meth:`Store.ingest_received`: ``verify`` (hashing a new
    shard file, or checking a received one is complete), ``store-blob`` (moving
    it into the blob store), ``record`` and ``recorded`` (around the shard's rows). Inside
    :meth:`Store.commit`: ``commit-flushed`` after every row of the version is written but
    before the transaction commits. With ``entry_points`` (a server, whose client announces
    nothing), also ``commit`` before and ``committed`` after :meth:`Store.commit`.
    """
    service.intake.ingest.verify_shard_file = _before(phases, "verify", service.intake.ingest.verify_shard_file)
    ShardReceiver.finish = _before(phases, "verify", ShardReceiver.finish)  # type: ignore[method-assign]
    LocalBlobStore.put_file = _before(phases, "store-blob", LocalBlobStore.put_file)  # type: ignore[method-assign]
    service.intake.ingest.record_shard = _around(phases, "record", "recorded", service.intake.ingest.record_shard)
    original_commit_version = service.catalog.commit.commit_version

    def commit_version(*args: Any, **kwargs: Any) -> Any:
        info = original_commit_version(*args, **kwargs)
        phases("commit-flushed")  # still inside the transaction: killing here must leave no version
        return info

    service.catalog.commit.commit_version = commit_version  # Store.commit imports it when called
    if entry_points:
        Store.commit = _around(phases, "commit", "committed", Store.commit)  # type: ignore[method-assign]


#: The steps :func:`install_compaction_hooks` announces, in the order a compaction reaches them.
COMPACTION_PHASES = (
    "write-shard",  # the live tensors read back, the new shard's staging file about to be created
    "write-head",  # its data written, its header not yet
    "store-blob",  # the complete file about to move into the blob store
    "record",  # the new shard's rows about to be written
    "recorded",
    "repoint",  # the exclusive lock about to be taken to move the live tensors' rows
    "repointed",  # moved and committed: the old shard is unreferenced, in its grace period
)


def install_compaction_hooks(phases: Phases) -> None:
    """Announce the steps of a compaction (:data:`COMPACTION_PHASES`)."""
    import ckptstore.service.reclaim.compaction  # noqa: F401  (binds service.reclaim.compaction for the name below)
    from ckptstore import service
    from ckptstore.service.intake.direct_file import DirectFileWriter

    service.intake.ingest.write_shard = _before(phases, "write-shard", service.intake.ingest.write_shard)
    DirectFileWriter.write_head = _before(phases, "write-head", DirectFileWriter.write_head)  # type: ignore[method-assign]
    LocalBlobStore.put_file = _before(phases, "store-blob", LocalBlobStore.put_file)  # type: ignore[method-assign]
    service.intake.ingest.record_shard = _around(phases, "record", "recorded", service.intake.ingest.record_shard)
    service.reclaim.compaction._repoint = _around(phases, "repoint", "repointed", service.reclaim.compaction._repoint)
