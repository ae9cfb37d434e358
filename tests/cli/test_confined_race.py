"""A folder inside the source swapped for a link to elsewhere while the import reads it.

:func:`client.formats.confined.open_regular` walks from the source folder's descriptor, no
component followed as a link the kernel resolves; so however the swap falls, a read either gets
the inside bytes or is refused, and never a byte from outside. A thread swaps the folder and the
link (atomically where the kernel can exchange two names) as fast as it can, while the reader
reads many times; links the rules accept (inside the folder, a cache snapshot's into its blobs)
still read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from ckptstore.client.formats import confined
from ckptstore.client.formats.importing import read_checkpoint
from ckptstore.service.errors import InvalidInputError

#: Reads per race, and the most seconds one race may take (whichever ends first).
READS = 3000
SECONDS = 8.0
INSIDE = b"inside-bytes-" * 8
OUTSIDE = b"OUTSIDE-BYTES" * 8
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchanger() -> Callable[[Path, Path], None]:
    """``exchange(a, b)``: swap two names atomically (``renameat2(RENAME_EXCHANGE)``), or where the
    kernel or libc cannot, by three renames (a moment with neither name in place)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)

    def by_renames(a: Path, b: Path) -> None:
        spare = a.with_name(a.name + ".swap")
        os.rename(a, spare)
        os.rename(b, a)
        os.rename(spare, b)

    if renameat2 is None:
        return by_renames

    def atomic(a: Path, b: Path) -> None:
        if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
            code = ctypes.get_errno()
            if code in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot exchange
                by_renames(a, b)
                return
            raise OSError(code, os.strerror(code), str(a))

    return atomic


@contextmanager
def swapping(folder: Path, link_to: Path) -> Iterator[list[int]]:
    """While in this context, ``folder`` (a real folder) keeps trading places with a link to
    ``link_to``; yields the count of swaps made so far."""
    link = folder.with_name(folder.name + ".link")
    link.symlink_to(link_to, target_is_directory=True)
    exchange = _exchanger()
    stop = threading.Event()
    swaps = [0]
    failures: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                exchange(folder, link)
                swaps[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not lost in the thread
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield swaps
    finally:
        stop.set()
        thread.join()
        if folder.is_symlink():  # leave the real folder in place
            exchange(folder, link)
    assert not failures, failures


def _race(read: Callable[[], bytes | None]) -> dict[str, int]:
    """``read()`` many times: how often it read the inside bytes, was refused, or read outside ones."""
    seen = {"inside": 0, "refused": 0, "outside": 0}
    deadline = time.monotonic() + SECONDS
    for _ in range(READS):
        try:
            data = read()
        except (InvalidInputError, OSError):
            seen["refused"] += 1
        else:
            seen["outside" if data is not None and OUTSIDE in data else "inside"] += 1
        if time.monotonic() > deadline:
            break
    return seen


def _bytes_of(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_folder_swapped_for_a_link_out_is_never_read_through(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    (source / "shards").mkdir(parents=True)
    (source / "shards" / "data.bin").write_bytes(INSIDE)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "data.bin").write_bytes(OUTSIDE)
    target = source / "shards" / "data.bin"
    with confined.reading(source), swapping(source / "shards", tmp_path / "elsewhere") as swaps:
        seen = _race(lambda: _bytes_of(confined.open_regular(target)))
    print(f"\n[folder swapped for a link] {swaps[0]} swaps: {seen}")
    assert seen["outside"] == 0, seen
    assert swaps[0] > 100 and seen["inside"] > 0 and seen["refused"] > 0, (swaps, seen)


def _weights(value: float) -> bytes:
    return save({"w": torch.full((8,), value)})


def _snapshot(tmp_path: Path) -> tuple[Path, Path]:
    """A hub cache snapshot whose ``model.safetensors`` links into ``blobs/``, and a look-alike
    ``blobs`` outside the repo holding other weights under the same name."""
    data = _weights(1.0)
    digest = hashlib.sha256(data).hexdigest()
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / digest).write_bytes(data)
    (snapshot / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / digest)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / digest).write_bytes(_weights(7.0))
    return snapshot, repo / "blobs"


@pytest.mark.slow
def test_a_cache_snapshot_whose_blobs_are_swapped_imports_inside_bytes_or_nothing(tmp_path: Path) -> None:
    snapshot, blobs = _snapshot(tmp_path)

    def read() -> bytes:
        weights = read_checkpoint(snapshot).model["w"]
        if torch.equal(weights, torch.full((8,), 7.0)):
            return OUTSIDE
        assert torch.equal(weights, torch.full((8,), 1.0)), weights
        return INSIDE

    with swapping(blobs, tmp_path / "elsewhere") as swaps:
        seen = _race(read)
    print(f"\n[cache blobs swapped for a link] {swaps[0]} swaps: {seen}")
    assert seen["outside"] == 0, seen
    assert swaps[0] > 100 and seen["inside"] > 0, (swaps, seen)


def test_links_inside_the_folder_are_followed(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    (source / "real").mkdir(parents=True)
    (source / "real" / "data.bin").write_bytes(INSIDE)
    (source / "alias").symlink_to("real", target_is_directory=True)
    (source / "file.bin").symlink_to("alias/data.bin")
    (source / "absolute.bin").symlink_to(source / "real" / "data.bin")
    with confined.reading(source):
        for name in ("alias/data.bin", "file.bin", "absolute.bin", "real/data.bin"):
            assert _bytes_of(confined.open_regular(source / name)) == INSIDE, name


@pytest.mark.parametrize("link", ["../elsewhere", "real/../../elsewhere", "ABSOLUTE"])
def test_a_folder_that_is_a_link_out_is_refused(tmp_path: Path, link: str) -> None:
    source = tmp_path / "ckpt"
    (source / "real").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "data.bin").write_bytes(OUTSIDE)
    (source / "shards").symlink_to(tmp_path / "elsewhere" if link == "ABSOLUTE" else link)
    with confined.reading(source), pytest.raises(InvalidInputError, match="is a link that points outside"):
        confined.open_regular(source / "shards" / "data.bin")


def test_a_loop_of_links_is_refused_past_the_limit(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "a").symlink_to("b")
    (source / "b").symlink_to("a")
    with confined.reading(source), pytest.raises(InvalidInputError, match="limit"):
        confined.open_regular(source / "a")


def test_a_file_named_as_a_folder_is_an_os_error_naming_the_path(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "data.bin").write_bytes(INSIDE)
    with confined.reading(source), pytest.raises(NotADirectoryError, match="data.bin/more"):
        confined.open_regular(source / "data.bin" / "more")
    with confined.reading(source), pytest.raises(FileNotFoundError, match="absent.bin"):
        confined.open_regular(source / "absent.bin")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    (source / "sub").mkdir(parents=True)
    os.mkfifo(source / "sub" / "pipe")
    with confined.reading(source), pytest.raises(InvalidInputError, match="regular file"):
        confined.open_regular(source / "sub" / "pipe")
