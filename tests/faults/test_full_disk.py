"""A store whose disk saves filled to the last byte: its own cleanup frees it, and full is told as full.

Every test mounts a real 24 MiB tmpfs (root may; elsewhere the tests skip, saying why) and puts
the whole store on it: SQLite's ``metadata.db``, ``blobs/`` and ``staging/``. Saves of distinct
1.5 MiB models fill it until the store answers StorageFullError; a filler file inside the store's
folder then takes what the failed save gave back, so ``df`` says 0 bytes available. From there
only the store's own commands are used: ``ckptstore rm`` and ``ckptstore gc`` (the real CLI, in
a process of its own) or the same calls over HTTP to a real uvicorn server.
"""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from ckptstore import client
from ckptstore.service.api import create_app
from ckptstore.service.errors import StorageFullError
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.servers import running_server

MIB = 1 << 20
DISK_BYTES = 24 * MIB
RESERVE_BYTES = 2 * MIB
RUN = "full"


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh 24 MiB tmpfs, unmounted afterwards; stores opened meanwhile keep a 2 MiB reserve and
    a client retries for the default minute (so a retried full disk would show)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount)], capture_output=True, text=True
        )
    except OSError as exc:
        pytest.skip(f"cannot run mount here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip() or done.returncode}")
    monkeypatch.setenv("CKPTSTORE_RESERVE_BYTES", str(RESERVE_BYTES))
    monkeypatch.delenv("CKPTSTORE_RETRY_SECONDS", raising=False)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def model(seed: int) -> nn.Module:
    """1.5 MiB of weights no other seed shares."""
    torch.manual_seed(seed)
    return nn.Linear(768, 512, bias=False)


def free_bytes(folder: Path) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def save_until_full(ckpt: client.Client) -> tuple[int, StorageFullError, float]:
    """Save new versions of ``RUN`` until the store refuses one; how many went in, the refusal,
    and the seconds the refused save took."""
    for number in itertools.count(1):
        assert number < 30, "24 MiB should not hold 30 saves of 1.5 MiB"
        started = time.monotonic()
        try:
            ckpt.save(RUN, model(number), step=number)
        except StorageFullError as exc:
            return number - 1, exc, time.monotonic() - started
    raise AssertionError("unreachable")


def fill_disk(folder: Path, leave: int = 0) -> None:
    """Write a filler file in ``folder`` until no more than ``leave`` bytes are free (0: none at all)."""
    descriptor = os.open(folder / f"filler-{leave}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for piece in (MIB, 64 << 10, 4 << 10, 1):
            chunk = b"\xff" * piece
            try:
                while free_bytes(folder) - piece >= leave:
                    os.write(descriptor, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(descriptor)
    if leave == 0:
        assert free_bytes(folder) == 0
    else:
        assert leave - (64 << 10) <= free_bytes(folder) <= leave


def ckptstore(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real ``ckptstore`` command, in a process of its own, on the embedded store in ``home``."""
    env = {**os.environ, "CKPTSTORE_HOME": str(home)}
    env.pop("CKPTSTORE_URL", None)
    command = [sys.executable, "-m", "ckptstore.client.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def assert_names_the_full_disk(message: str, home: Path) -> None:
    assert "is full" in message and str(home) in message, message
    assert "ckptstore rm" in message and "ckptstore gc" in message, message


def test_an_embedded_store_filled_to_its_last_byte_is_freed_by_rm_and_gc_alone(disk: Path) -> None:
    home = disk / "home"
    with client.Client(home=home) as ckpt:
        saved, refused, _seconds = save_until_full(ckpt)
    assert saved >= 4
    assert_names_the_full_disk(str(refused), home)
    assert (home / "reserve").stat().st_blocks * 512 >= RESERVE_BYTES  # real blocks, not a sparse file
    fill_disk(home)

    ok(ckptstore(home, "rm", f"{RUN}@1", "--yes"))
    ok(ckptstore(home, "rm", f"{RUN}@2", "--yes"))
    swept = ok(ckptstore(home, "gc", "--grace", "0"))

    assert swept.startswith("swept 2 shards"), swept
    assert (home / "reserve").stat().st_size == RESERVE_BYTES  # made again once gc gave room back
    with client.Client(home=home) as ckpt:
        again = ckpt.save(RUN, model(100), step=100)
        assert [v.version for v in ckpt.versions(RUN)] == [*range(3, saved + 1), again.version]
        target = model(0)
        ckpt.load(RUN, model=target)
        assert torch.equal(target.weight, model(100).weight)


def test_a_server_on_a_full_disk_answers_507_at_once_and_rm_and_gc_over_http_free_it(disk: Path) -> None:
    home = disk / "home"
    store = Store.open_home(home)
    try:
        with running_server(create_app(store, Settings(home=home))) as url, client.Client(url) as ckpt:
            saved, refused, seconds = save_until_full(ckpt)
            assert saved >= 4
            assert seconds < 10, f"a full disk was retried for {seconds:.0f} s"
            assert_names_the_full_disk(str(refused), home)
            fill_disk(home)

            with httpx.Client(base_url=url, timeout=60) as http:
                compressing = http.post("/v1/gc", json={"compress": True, "grace_seconds": 0})
            assert compressing.status_code == 507, compressing.text
            assert compressing.headers["x-error-code"] == "storage_full"
            assert_names_the_full_disk(compressing.json()["message"], home)

            assert ckpt.delete(RUN, 1) == 1 and ckpt.delete(RUN, 2) == 2
            report = ckpt.gc(grace_seconds=0)
            assert report.shards_swept == 2
            again = ckpt.save(RUN, model(100), step=100)
            assert [v.version for v in ckpt.versions(RUN)] == [*range(3, saved + 1), again.version]
    finally:
        store.close()


def test_an_embedded_gc_compress_on_a_full_disk_prints_one_line_naming_it(disk: Path) -> None:
    home = disk / "home"
    with client.Client(home=home) as ckpt:
        save_until_full(ckpt)

    fill_disk(home, leave=MIB + (128 << 10))  # room to open the store, not to write a compressed shard
    short = ckptstore(home, "gc", "--compress", "--grace", "0")
    fill_disk(home)
    full = ckptstore(home, "gc", "--compress", "--grace", "0")

    for done in (short, full):
        lines = done.stderr.splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert lines[0].startswith("error: ") and "Errno" not in lines[0], lines[0]
        assert_names_the_full_disk(lines[0], home)
    ok(ckptstore(home, "rm", f"{RUN}@1", "--yes"))  # and the store can still be freed
