"""DirectFileWriter: exact files whatever the write sizes, written around the page cache."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service import direct_file
from service.direct_file import ALIGNMENT, BUFFER_BYTES, DirectFileWriter
from service.store import Store

_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (``mincore`` on a mapping that touches none)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        vector = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        del address
        return sum(byte & 1 for byte in vector)


def write_in_pieces(
    path: Path, data: bytes, sizes: list[int], *, direct: bool, write_behind: bool = False
) -> DirectFileWriter:
    writer = DirectFileWriter(path, direct=direct, write_behind=write_behind)
    start = 0
    for size in sizes:
        writer.write(memoryview(data)[start : start + size])
        start += size
    writer.write(memoryview(data)[start:])
    writer.close()
    return writer


piece_sizes = st.lists(
    st.one_of(st.integers(0, 3 * ALIGNMENT), st.integers(BUFFER_BYTES - 2, BUFFER_BYTES + ALIGNMENT)), max_size=5
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=piece_sizes, direct=st.booleans(), write_behind=st.booleans())
def test_the_file_holds_exactly_the_bytes_written_whatever_the_piece_sizes(
    tmp_path: Path, sizes: list[int], direct: bool, write_behind: bool
) -> None:
    data = os.urandom(sum(sizes) + 17)
    path = tmp_path / f"f{os.urandom(4).hex()}"
    writer = write_in_pieces(path, data, sizes, direct=direct, write_behind=write_behind)
    assert writer.size == len(data)
    assert path.stat().st_size == len(data)  # the padded last block was cut off again
    assert path.read_bytes() == data


def test_direct_writes_leave_the_page_cache_empty_and_buffered_ones_fill_it(tmp_path: Path) -> None:
    data = os.urandom(3 * BUFFER_BYTES + 12345)
    sizes = [1000, 5 * ALIGNMENT + 3, BUFFER_BYTES]
    direct = write_in_pieces(tmp_path / "direct", data, sizes, direct=True)
    buffered = write_in_pieces(tmp_path / "buffered", data, sizes, direct=False)
    assert direct.direct, f"{tmp_path}'s file system refused O_DIRECT"
    assert not buffered.direct
    pages = -(-len(data) // mmap.PAGESIZE)
    assert cached_pages(tmp_path / "direct") == 0
    assert cached_pages(tmp_path / "buffered") == pages
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "buffered").read_bytes() == data


def test_a_direct_write_the_file_system_refuses_is_done_buffered_instead(tmp_path: Path) -> None:
    writer = DirectFileWriter(tmp_path / "f", direct=True)
    assert writer.direct
    unaligned = memoryview(bytearray(b"x" * 4097))[1:]  # O_DIRECT refuses this memory (EINVAL)
    writer._write_all(unaligned)  # as a file system that took the flag at open but refuses the write
    assert not writer.direct
    writer.write(b"tail")
    writer.close()
    assert (tmp_path / "f").read_bytes() == b"x" * 4096 + b"tail"


@pytest.mark.parametrize("direct", [True, False])
def test_a_failed_background_write_is_raised_by_the_next_call_and_nothing_is_written_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    calls: list[int] = []

    class FullDisk:
        """``os`` whose second write finds the disk full."""

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        @staticmethod
        def write(fd: int, data: memoryview) -> int:
            calls.append(memoryview(data).nbytes)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return os.write(fd, data)

    monkeypatch.setattr(direct_file, "os", FullDisk())
    writer = DirectFileWriter(tmp_path / "f", direct=direct, write_behind=True)
    block = bytes(BUFFER_BYTES)
    with pytest.raises(OSError) as caught:
        for _ in range(5):  # direct: the second buffer's write fails in the background
            writer.write(block)
        writer.close()
    assert caught.value.errno == errno.ENOSPC
    assert calls == [BUFFER_BYTES, BUFFER_BYTES]  # nothing was written after the failure
    writer.abort()  # still closes cleanly
    assert (tmp_path / "f").stat().st_size == BUFFER_BYTES


def test_abort_closes_the_file_without_writing_what_is_buffered(tmp_path: Path) -> None:
    writer = DirectFileWriter(tmp_path / "f")
    writer.write(b"never written")
    writer.abort()
    writer.abort()  # idempotent, as is close() after it
    writer.close()
    assert (tmp_path / "f").read_bytes() == b""


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        DirectFileWriter(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == b"keep"


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("false", False), ("1", True)])
def test_the_embedded_store_takes_direct_writes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.setenv("CKPTSTORE_DIRECT_WRITES", value)  # unset: measured (tests/service/test_write_probe.py)
    store = Store.open_home(tmp_path)
    try:
        assert store.direct_writes is expected
        assert store.receiver().direct_writes is expected
        assert store.receiver(write_behind=True).write_behind
    finally:
        store.close()


@pytest.mark.parametrize("direct", [True, False])
def test_room_left_at_the_start_takes_the_head_written_last(tmp_path: Path, direct: bool) -> None:
    head, body = os.urandom(2 * ALIGNMENT), os.urandom(BUFFER_BYTES + 12345)
    path = tmp_path / "f"
    writer = DirectFileWriter(path, direct=direct, start=len(head))
    writer.write(body)
    writer.write_head(head)
    writer.close()
    assert path.read_bytes() == head + body
    assert writer.size == len(head) + len(body)


def test_the_room_at_the_start_is_whole_blocks_and_the_head_fills_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        DirectFileWriter(tmp_path / "a", start=100)
    writer = DirectFileWriter(tmp_path / "b", start=ALIGNMENT)
    try:
        with pytest.raises(ValueError, match="4096 bytes, not 10"):
            writer.write_head(b"x" * 10)
    finally:
        writer.abort()
