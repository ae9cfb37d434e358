"""Cleaning what killed processes leave: staging files, .incoming copies, client upload folders."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.client.http.transport import HttpTransport, remove_stale_staging
from ckptstore.service.api.server import app_from_env
from ckptstore.service.blobs.held_file import hold_new
from ckptstore.service.reclaim.cleanup import CleanupReport, clean_staging
from ckptstore.service.store import Store

HOUR = 3600.0


def aged(path: Path, seconds: float) -> Path:
    stamp = path.stat().st_mtime - seconds
    os.utime(path, (stamp, stamp), follow_symlinks=False)
    return path


def touch(path: Path, data: bytes = b"x" * 10) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open_home(tmp_path / "home")
    yield opened
    opened.close()


def test_temporary_files_nobody_holds_are_removed_whatever_their_age(store: Store, tmp_path: Path) -> None:
    staging, incoming = store.staging_dir, tmp_path / "home" / "blobs" / ".incoming"
    old = aged(touch(staging / "a.incomplete", b"x" * 100), 2 * HOUR)
    old_copy = aged(touch(incoming / "b.c.incomplete", b"y" * 7), 2 * HOUR)
    young = touch(staging / "c.incomplete", b"z" * 3)
    writing, copying = hold_new(staging / "w.incomplete"), hold_new(incoming / "x.y.incomplete")
    aged(writing.path, 2 * HOUR)  # held: however old, a live process is writing it
    other = aged(touch(staging / "notes.txt"), 2 * HOUR)  # not a name the store writes
    folder = staging / "d.incomplete"
    folder.mkdir()
    aged(folder, 2 * HOUR)
    outside = touch(tmp_path / "precious.incomplete")
    link = staging / "e.incomplete"
    link.symlink_to(outside)
    aged(link, 2 * HOUR)

    assert clean_staging(store, dry_run=True) == CleanupReport(removed=3, bytes_removed=110, in_use=2)
    assert old.exists() and old_copy.exists() and young.exists()  # a dry run removes nothing
    report = store.clean_staging()

    assert report == CleanupReport(removed=3, bytes_removed=110, kept=0, failed=0, in_use=2)
    assert not old.exists() and not old_copy.exists() and not young.exists()
    assert writing.path.exists() and copying.path.exists()
    assert other.exists() and folder.is_dir()
    assert link.is_symlink() and outside.read_bytes() == b"x" * 10  # never followed, never ours
    writing.remove()
    copying.release()  # its writer is gone: the file is a leftover now
    assert store.clean_staging() == CleanupReport(removed=1, bytes_removed=0)
    assert not copying.path.exists()


def test_a_limit_bounds_the_files_looked_at_and_a_negative_threshold_is_refused(store: Store) -> None:
    for name in "abcde":
        touch(store.staging_dir / f"{name}.incomplete")
    assert clean_staging(store, limit=2).removed == 2
    assert clean_staging(store, 10.0, now=0.0).removed == 3  # the threshold judges no lockable file
    assert list(store.staging_dir.iterdir()) == []
    with pytest.raises(ValueError):
        store.clean_staging(-1)


def test_a_starting_server_removes_the_staging_files_nobody_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    Store.open_home(home).close()
    killed = touch(home / "staging" / "killed.incomplete")  # fresh: its writer died a moment ago
    uploading = hold_new(home / "staging" / "uploading.incomplete")  # another worker's, being received
    aged(uploading.path, 2 * HOUR)
    monkeypatch.setenv("CKPTSTORE_HOME", str(home))
    for name in ("CKPTSTORE_DATABASE_URL", "CKPTSTORE_BLOBS", "CKPTSTORE_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    app = app_from_env()
    assert app is not None
    assert not killed.exists() and uploading.path.exists()
    uploading.remove()


def test_stale_client_upload_folders_go_when_old_and_their_process_is_gone(tmp_path: Path) -> None:
    dead = dead_pid()
    gone = aged(touch(tmp_path / f"ckptstore-upload-{dead}-abc" / "x.shard").parent, 2 * HOUR)
    legacy = aged(touch(tmp_path / "ckptstore-upload-k2j4h1" / "x.shard").parent, 2 * HOUR)
    recent = touch(tmp_path / f"ckptstore-upload-{dead}-new" / "x.shard").parent
    alive = aged(touch(tmp_path / f"ckptstore-upload-{os.getpid()}-idle" / "x.shard").parent, 2 * HOUR)
    not_a_folder = aged(touch(tmp_path / "ckptstore-upload-file"), 2 * HOUR)
    unrelated = aged(touch(tmp_path / "other" / "x.shard").parent, 2 * HOUR)

    assert remove_stale_staging(tmp_path) == 1
    assert not gone.exists()
    assert recent.exists() and alive.exists() and not_a_folder.exists() and unrelated.exists()
    assert legacy.exists()  # no process id in the name: its owner cannot be known
    assert remove_stale_staging(tmp_path, older_than_seconds=0) == 1  # recent, once old enough
    assert alive.exists()  # a live client's folder stays, however idle


def test_a_new_http_transport_removes_folders_killed_clients_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = aged(touch(tmp_path / f"ckptstore-upload-{dead_pid()}-abc" / "x.shard").parent, 2 * HOUR)
    HttpTransport("http://127.0.0.1:9").close()
    assert not left.exists()
    assert list(tmp_path.iterdir()) == []  # uploads stream from memory: a client stages nothing
