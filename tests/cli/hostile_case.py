"""What a hostile import case is: the source it builds, the file its refusal names, the words it says,
and the bounds its refusal is held to. The corpus is :mod:`tests.cli.hostile_imports` (code in pickles,
paths, shapes, configs) and :mod:`tests.cli.hostile_reuse` (aliasing, amplification, work before the
bounds, escapes, races)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

MARKER = "pwned"
#: The bounds a refusal of the second probe's cases is held to: seconds and peak RSS (MiB).
WITHIN_S = 10.0
MAX_RSS_MIB = 500.0

# What each refusal must say (lowercase; a tuple inside is "any one of"), adjusted here in one place.
Says = tuple[str | tuple[str, ...], ...]
OUTSIDE: Says = ("outside",)
LINK: Says = ("link",)
NOT_REGULAR: Says = ("regular file",)
PAST_END: Says = (("past the end", "negative"),)
LIMIT: Says = ("limit",)
UNCOVERED: Says = ("uncovered",)
OVERLAP: Says = ("overlap",)
REMOTE_CODE: Says = ("remote code",)
NOT_A_MODEL: Says = ("not a transformers model class",)
OVERFLOW: Says = ("overflow",)
COMPRESSED: Says = ("compressed",)
NOT_A: Says = ("not a",)


def global_named(name: str) -> Says:
    """A disallowed global, named: ``global`` and the callable's name (``system``, ``eval``, ``Popen``)."""
    return ("global", name.lower())


def tensor_bytes(key: str) -> Says:
    """A tensor claiming more elements than the bytes behind it: its key and ``bytes``."""
    return (key.lower(), "bytes")


def marker(work: Path) -> Path:
    """The file a code-execution payload creates: it must never exist after an import."""
    return work / MARKER


def elsewhere(work: Path) -> Path:
    """Where a path escaping the source lands (named so no expected word is in its path)."""
    (work / "elsewhere").mkdir(exist_ok=True)
    return work / "elsewhere"


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile source and what its refusal must hold.

    ``isolated`` cases (bombs, hangs, remote code) run as their own ``ckptstore`` process under
    the memory and hang guards; ``answer`` is what that process finds on stdin.
    """

    id: str
    build: Callable[[Path], Path]
    #: The file the error must name; a tuple: any one of them (the .metadata naming an offset, or the
    #: .distcp it points past the end of).
    offending: str | tuple[str, ...]
    says: Says
    isolated: bool = False
    answer: bytes | None = None
    #: The most seconds the refusal may take, where failing fast is part of the contract.
    within_s: float | None = None
    #: The most peak RSS (MiB) the refusing process may reach, where it is tighter than the suite's guard.
    max_rss_mib: float | None = None
    #: Import with ``os.system`` registered as a copyreg extension (what an ``EXT1`` payload names).
    extension: bool = False

    def make(self, work: Path) -> tuple[Path, str | tuple[str, ...], Says]:
        """Write the case under ``work``: the source to import, the file the error names, the words it says."""
        return self.build(work), self.offending, self.says
