"""The durability steps a SIGKILL cannot show (the page cache survives a killed process).

A kill test proves a crash leaves the old or the new state; only the order of fsyncs and
renames makes that hold after a power cut too. Traced here on a real save: each blob is
written under a temporary name, fsynced, renamed, and its folder fsynced after the rename;
the database commits with WAL and synchronous=FULL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ckptstore.client.api import Client
from ckptstore.service.store import Store
from tests.stress.model import StressNet


def test_every_blob_is_fsynced_then_renamed_then_its_folder_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
        real_fsync(fd)

    def replace(source: Any, target: Any) -> None:
        events.append(("replace", os.path.abspath(source), os.path.abspath(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    home = (tmp_path / "home").resolve()
    with Client(home=home, shard_bytes=192 << 10) as ckpt:
        result = ckpt.save("run", StressNet(3, 0), step=0)
    monkeypatch.undo()

    blobs = sorted(p for p in (home / "blobs").glob("??/*") if p.is_file())
    assert len(blobs) == result.shards >= 5
    for blob in blobs:
        renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(blob)]
        assert len(renames) == 1, f"{blob.name} did not arrive by exactly one rename"
        at = renames[0]
        source = events[at][1]
        assert Path(source).name.endswith(".incomplete"), "a blob is written under a temporary name"
        assert ("fsync", source, "") in events[:at], f"{blob.name} was renamed before its bytes were fsynced"
        assert ("fsync", str(blob.parent), "") in events[at + 1 :], f"{blob.parent} not fsynced after the rename"


def test_the_database_commits_durably(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path)
    try:
        with store.db.engine.connect() as connection:
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert connection.execute(text("PRAGMA synchronous")).scalar() == 2  # FULL
    finally:
        store.close()
