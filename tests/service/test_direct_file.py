"""DirectFileWriter: exact files whatever the write sizes and writes in flight, written around the
page cache, or buffered with the write-back started as the bytes arrive."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.intake import direct_file
from ckptstore.service.intake.direct_file import ALIGNMENT, BUFFER_BYTES, WRITEBACK_BYTES, DirectFileWriter
from ckptstore.service.store import Store

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
    path: Path,
    data: bytes,
    sizes: list[int],
    *,
    direct: bool,
    in_flight: int = 0,
    observe: Callable[[memoryview], object] | None = None,
) -> DirectFileWriter:
    writer = DirectFileWriter(path, direct=direct, in_flight=in_flight)
    start = 0
    for size in sizes:
        writer.write(memoryview(data)[start : start + size], observe)
        start += size
    writer.write(memoryview(data)[start:], observe)
    writer.close()
    return writer


piece_sizes = st.lists(
    st.one_of(st.integers(0, 3 * ALIGNMENT), st.integers(BUFFER_BYTES - 2, BUFFER_BYTES + ALIGNMENT)), max_size=5
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=piece_sizes, direct=st.booleans(), in_flight=st.sampled_from([0, 1, 3]))
def test_the_file_holds_exactly_the_bytes_written_whatever_the_piece_sizes(
    tmp_path: Path, sizes: list[int], direct: bool, in_flight: int
) -> None:
    data = os.urandom(sum(sizes) + 17)
    path = tmp_path / f"f{os.urandom(4).hex()}"
    observed = bytearray()
    writer = write_in_pieces(path, data, sizes, direct=direct, in_flight=in_flight, observe=observed.extend)
    assert writer.size == len(data)
    assert path.stat().st_size == len(data)  # the padded last block was cut off again
    assert path.read_bytes() == data
    assert observed == data  # every piece seen once, in order


def test_observe_sees_the_bytes_as_copied_not_the_callers_memory_afterwards(tmp_path: Path) -> None:
    # A caller whose memory changes while it is written (a tensor updated in place) gets a file
    # and an observed stream that agree: both are the writer's copy.
    source = bytearray(os.urandom(2 * BUFFER_BYTES + 100))
    observed = bytearray()

    def observe(piece: memoryview) -> None:
        observed.extend(piece)
        source[:] = bytes(len(source))  # the caller's memory is zeroed after the first piece lands

    writer = DirectFileWriter(tmp_path / "f", in_flight=2)
    writer.write(memoryview(source), observe)
    writer.close()
    assert (tmp_path / "f").read_bytes() == bytes(observed)
    assert any(observed) and not all(observed[BUFFER_BYTES:])


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
    writer = DirectFileWriter(tmp_path / "f", direct=True, start=ALIGNMENT)
    assert writer.direct
    writer.write(b"tail")
    unaligned = memoryview(bytearray(b"x" * 4097))[1:]  # O_DIRECT refuses this memory (EINVAL)
    writer._write_at(unaligned, 0)  # as a file system that took the flag at open but refuses the write
    assert not writer.direct
    writer.close()
    assert (tmp_path / "f").read_bytes() == b"x" * 4096 + b"tail"


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("in_flight", [1, 3])
def test_a_failed_background_write_is_raised_and_no_write_starts_after_it_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, in_flight: int
) -> None:
    calls: list[int] = []

    class FullDisk:
        """``os`` whose second write finds the disk full."""

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        @staticmethod
        def pwrite(fd: int, data: memoryview, position: int) -> int:
            calls.append(position)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return os.pwrite(fd, data, position)

    monkeypatch.setattr(direct_file, "os", FullDisk())
    writer = DirectFileWriter(tmp_path / "f", direct=direct, in_flight=in_flight)
    block = bytes(BUFFER_BYTES)
    with pytest.raises(OSError) as caught:
        for _ in range(5 + in_flight):  # the second buffer's write fails in the background
            writer.write(block)
        writer.close()
    assert caught.value.errno == errno.ENOSPC
    assert len(calls) <= 2 + in_flight  # at most the writes already on their way when it failed
    seen = len(calls)
    with pytest.raises(OSError):
        for _ in range(3):
            writer.write(block)
    assert len(calls) == seen  # once the failure is known, nothing more is written
    writer.abort()  # still closes cleanly


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


def test_a_buffered_file_starts_its_write_back_early_and_leaves_the_page_cache(tmp_path: Path) -> None:
    # Each stretch's write-back is started as it is written and the stretch before it dropped
    # once on the device: a large buffered file leaves little dirty memory for the final fsync.
    data = os.urandom(6 * WRITEBACK_BYTES + 999)
    writer = write_in_pieces(tmp_path / "f", data, [BUFFER_BYTES] * 6, direct=False, in_flight=2)
    assert not writer.direct
    total = -(-len(data) // mmap.PAGESIZE)
    behind = (2 * WRITEBACK_BYTES + 3 * BUFFER_BYTES) // mmap.PAGESIZE  # the last stretches, writes in flight
    assert cached_pages(tmp_path / "f") <= behind < total
    assert (tmp_path / "f").read_bytes() == data


def test_warmed_buffers_fill_the_idle_pool_up_to_its_cap_and_serve_the_next_file(tmp_path: Path) -> None:
    direct_file._idle_buffers.clear()
    direct_file.warm_buffers(3)
    warmed = {id(buffer) for buffer in direct_file._idle_buffers}
    assert len(warmed) == 3
    writer = direct_file.DirectFileWriter(tmp_path / "f", direct=False)
    writer.write(b"x" * 10)
    writer.close()
    assert (tmp_path / "f").read_bytes() == b"x" * 10
    assert {id(buffer) for buffer in direct_file._idle_buffers} == warmed  # taken from the pool, given back
    direct_file.warm_buffers(10 * direct_file.MAX_IDLE_BUFFERS)
    assert len(direct_file._idle_buffers) == direct_file.MAX_IDLE_BUFFERS
