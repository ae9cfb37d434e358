"""A process that runs ``gc --compact-below 0.5`` on a store, announcing each step of the compaction
and waiting to be let on (the phase protocol of tests.stress.phases), so the driver can SIGKILL it
at exactly that step: tests/stress/test_compaction_kill.py.

    python -m tests.stress.compactor HOME [DATABASE_URL]

Without ``DATABASE_URL`` the store is the embedded one at ``HOME``; with it, that database with
blobs and staging under ``HOME``. Prints ``done <shards compacted>`` when the collection returns.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database
from ckptstore.service.store import Store
from tests.stress.phases import Phases, die_with_parent, install_compaction_hooks, say


def open_store(home: Path, database_url: str | None) -> Store:
    """The store the driver built: embedded at ``home``, or ``database_url`` with files under ``home``."""
    if database_url is None:
        return Store.open_home(home, direct_writes=True)
    return Store(Database(database_url), LocalBlobStore(home / "blobs"), home / "staging", direct_writes=True)


def main() -> None:
    die_with_parent()
    install_compaction_hooks(Phases(wait=True))
    store = open_store(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
    try:
        report = store.gc(compact_below=0.5)
    finally:
        store.close()
    say(f"done {report.shards_compacted}")


if __name__ == "__main__":
    main()
