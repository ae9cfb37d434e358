"""The schema revisions this ckptstore's migration scripts define, read without Alembic or SQLAlchemy.

Alembic is imported only to migrate: checking a store's revision (every time a store is opened,
every ``ckptstore ls``) reads the version table and the scripts' own revision lines instead,
which costs a few milliseconds where importing Alembic and loading its scripts costs 0.15 s.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from ckptstore.service import migrations
from ckptstore.service.errors import StorageError

_REVISION = re.compile(r"^revision(?:\s*:[^=\n]*)?\s*=\s*[\"']([^\"']+)[\"']", re.MULTILINE)
_DOWN = re.compile(r"^down_revision(?:\s*:[^=\n]*)?\s*=\s*(?:None|[\"']([^\"']+)[\"'])", re.MULTILINE)


def migrations_dir() -> Path:
    """The folder holding ``env.py`` and ``versions/``, wherever the package is installed."""
    return Path(migrations.__file__).parent


@lru_cache(maxsize=1)
def revisions() -> dict[str, str | None]:
    """Each revision the migration scripts define, with the one it follows (None for the first)."""
    found: dict[str, str | None] = {}
    for script in sorted((migrations_dir() / "versions").glob("*.py")):
        source = script.read_text(encoding="utf-8")
        revision, down = _REVISION.search(source), _DOWN.search(source)
        if revision is not None and down is not None:
            found[revision.group(1)] = down.group(1)
    return found


def head_revision() -> str:
    """The newest revision this ckptstore's migrations know."""
    known = revisions()
    heads = sorted(set(known) - {down for down in known.values() if down is not None})
    if len(heads) != 1:  # pragma: no cover - the package ships one line of migrations
        raise StorageError(f"migrations in {migrations_dir()} have heads {heads}; the ckptstore installation is broken")
    return heads[0]
