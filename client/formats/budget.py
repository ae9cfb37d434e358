"""What one import may make from its source's own bytes: a multiple of their size, not a cap per object.

Every reader refuses a single object that claims more than the bytes behind it. Reuse is how a
small file makes a big state without any one object lying: many DCP chunks reading one stored
item, many tensors over one storage each cloned, zip entries sharing one region. So an import
is charged, before each tensor is made, the bytes of that tensor (a view counts as much as a
copy: both are stored), and the whole import may make at most :data:`DEFAULT_MAX_EXPANSION`
times the bytes of its source (:func:`source_bytes`), plus :data:`SLACK_BYTES`. A real
checkpoint makes about its own size (tied weights a little more); a user with a reason to go
further raises the multiple (``ckptstore import --max-expansion``, ``max_expansion=``).

The budget lives in a context variable set by :func:`budgeted` around one import, so the readers
charge it without threading it through every call; outside one, :func:`charge` counts nothing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from ckptstore.service.errors import InvalidInputError

#: What an import may make, as a multiple of its source's bytes, unless the user raises it.
DEFAULT_MAX_EXPANSION = 4.0
#: Made on top of the multiple, so a tiny source's bookkeeping never trips it.
SLACK_BYTES = 1 << 20
#: Most entries of a source folder counted for its size (a folder of more is refused).
MAX_FOLDER_ENTRIES = 100_000


@dataclass
class ImportBudget:
    """The bytes one import may still make: ``limit`` in all, ``made`` so far."""

    source: int
    multiple: float
    made: int = 0

    @property
    def limit(self) -> int:
        """The most bytes the import may make: ``multiple`` × the source's bytes, plus the slack."""
        return int(self.multiple * self.source) + SLACK_BYTES

    def charge(self, nbytes: int, subject: str) -> None:
        """Count ``nbytes`` more made for ``subject``, refusing first if that passes the limit.

        Raises:
            InvalidInputError: naming ``subject``, the bytes and the limit, and how to raise it.
        """
        if nbytes < 0:
            raise InvalidInputError(f"{subject}: a negative size ({nbytes} bytes)")
        if self.made + nbytes > self.limit:
            raise InvalidInputError(
                f"{subject}: making {nbytes} more bytes would bring this import to {self.made + nbytes} bytes "
                f"from a source of {self.source}, past the limit of {self.multiple:g}x its size "
                f"({self.limit} bytes): a checkpoint makes about its own size, so this one reuses its bytes; "
                "if it is genuine, raise the limit with --max-expansion"
            )
        self.made += nbytes


_active: ContextVar[ImportBudget | None] = ContextVar("ckptstore_import_budget", default=None)


def source_bytes(source: Path) -> int:
    """The bytes of ``source``: a file's size, or the sizes of the regular files directly in a folder
    (links followed, as a Hugging Face cache snapshot's are).

    Raises:
        InvalidInputError: the folder has more than :data:`MAX_FOLDER_ENTRIES` entries.
    """
    if not source.is_dir():
        return source.stat().st_size
    total = 0
    with os.scandir(source) as entries:
        for count, entry in enumerate(entries):
            if count >= MAX_FOLDER_ENTRIES:
                raise InvalidInputError(f"{source}: more than {MAX_FOLDER_ENTRIES} entries, past the limit")
            try:
                found = entry.stat(follow_symlinks=True)
            except OSError:
                continue  # a dangling link makes nothing; the reader names it if it is needed
            if stat.S_ISREG(found.st_mode):
                total += found.st_size
    return total


@contextmanager
def budgeted(source: Path, multiple: float = DEFAULT_MAX_EXPANSION) -> Iterator[ImportBudget]:
    """In this context, the readers' :func:`charge` counts against a budget of ``multiple`` × the
    bytes of ``source``.

    Raises:
        InvalidInputError: ``multiple`` is not a positive number.
    """
    if isinstance(multiple, bool) or not isinstance(multiple, (int, float)) or not multiple > 0:
        raise InvalidInputError(f"the import's expansion limit must be a positive number, not {multiple!r}")
    budget = ImportBudget(source=source_bytes(source), multiple=float(multiple))
    token = _active.set(budget)
    try:
        yield budget
    finally:
        _active.reset(token)


def charge(nbytes: int, subject: str) -> None:
    """Count ``nbytes`` made for ``subject`` against the import's budget, if one is active.

    Raises:
        InvalidInputError: the import would make more than its budget allows.
    """
    budget = _active.get()
    if budget is not None:
        budget.charge(nbytes, subject)


def active() -> ImportBudget | None:
    """The budget of the import under way in this context, or None."""
    return _active.get()


__all__ = ["DEFAULT_MAX_EXPANSION", "ImportBudget", "active", "budgeted", "charge", "source_bytes"]
