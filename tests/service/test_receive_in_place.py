"""Upload bytes received in place: straight into a staging file's write buffer, then hashed and
written from there (``space`` and ``landed`` of the receivers, ``space`` and ``advance`` of
:class:`DirectFileWriter`), as :mod:`service.api.http.socket_body` receives a large body.

Whatever sizes the bytes land in, the file, the digests and every refusal are those of the
same bytes given to ``write``.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.errors import IntegrityError, InvalidInputError, InvalidShardError
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.sharding import encode_layout
from ckptstore.service.intake.direct_file import ALIGNMENT, BUFFER_BYTES, DirectFileWriter
from ckptstore.service.intake.receiver import ShardReceiver
from ckptstore.service.intake.unhashed_receiver import UnhashedReceiver
from tests.service.shardkit import RawTensor, build_shard, raw

#: Tensors that cross the staging file's 4 MiB buffers, with small ones between them.
TENSORS = [raw("F32", [3, 1 << 19], 1), raw("BF16", [7], 2), raw("U8", [BUFFER_BYTES + 5], 3), raw("I64", [3], 4)]
SHARD = build_shard(TENSORS)
HEADS = st.lists(st.one_of(st.integers(1, 5000), st.integers(1, 3 * BUFFER_BYTES)), min_size=1, max_size=12)
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def land(receiver: ShardReceiver | UnhashedReceiver, data: bytes, sizes: list[int]) -> int:
    """Receive ``data`` into the receiver's space in pieces of at most the drawn sizes, then of
    whatever space it gives; returns how many pieces landed in the staging file's buffer rather
    than the receiver's own memory."""
    done, in_place, turn = 0, 0, 0
    while done < len(data):
        space = receiver.space()
        assert space.nbytes > 0
        take = min(sizes[turn] if turn < len(sizes) else space.nbytes, space.nbytes, len(data) - done)
        space[:take] = data[done : done + take]
        in_place += isinstance(space.obj, mmap.mmap)
        del space
        receiver.landed(take)
        done, turn = done + take, turn + 1
    return in_place


@SETTINGS
@given(sizes=HEADS, direct=st.booleans())
def test_any_landing_sizes_give_the_file_written_from_the_same_bytes(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], direct: bool
) -> None:
    path = tmp_path_factory.mktemp("inplace") / "shard"
    receiver = ShardReceiver(path, expected_id=SHARD.shard_id, direct_writes=direct, write_behind=True)
    in_place = land(receiver, SHARD.data, sizes)
    header = receiver.finish()
    assert header.shard_id == SHARD.shard_id
    assert [e.digest for e in header.entries] == [t.digest for t in TENSORS]
    assert path.read_bytes() == SHARD.data
    assert in_place > 0  # the tensors' bytes went into the staging buffer, not through a copy
    receiver.discard()


@pytest.mark.parametrize("position", [0, (3 << 21) - 1, (3 << 21) + 14, len(SHARD.data) - SHARD.header_length - 1])
def test_a_flipped_byte_landed_in_place_is_refused_and_leaves_nothing(tmp_path: Path, position: int) -> None:
    data = bytearray(SHARD.data)
    data[SHARD.header_length + position] ^= 0x01
    receiver = ShardReceiver(tmp_path / "s", expected_id=SHARD.shard_id, write_behind=True)
    with pytest.raises(IntegrityError, match="hashes to"):
        land(receiver, bytes(data), [1 << 20])
        receiver.finish()
    receiver.discard()
    assert not (tmp_path / "s").exists()


def test_bytes_landed_past_the_shards_end_are_refused_as_trailing(tmp_path: Path) -> None:
    receiver = ShardReceiver(tmp_path / "s", write_behind=True)
    with pytest.raises(InvalidShardError, match="trailing"):
        land(receiver, SHARD.data + b"PK\x03\x04", [BUFFER_BYTES])
    receiver.discard()
    assert not (tmp_path / "s").exists()


def test_a_landing_larger_than_the_space_given_is_refused(tmp_path: Path) -> None:
    receiver = ShardReceiver(tmp_path / "s")
    land(receiver, SHARD.data[: SHARD.header_length], [1 << 16])
    space = receiver.space()
    with pytest.raises(ValueError, match="did not land"):
        receiver.landed(space.nbytes + 1)
    receiver.discard()


def unhashed_receiver(path: Path, length: int, direct: bool = True) -> UnhashedReceiver:
    return UnhashedReceiver(path, length=length, max_bytes=1 << 30, max_layout_bytes=1 << 20, direct_writes=direct)


def unhashed_body(tensors: list[RawTensor]) -> bytes:
    return encode_layout([(t.dtype, t.shape) for t in tensors]) + b"".join(t.data for t in tensors)


@SETTINGS
@given(sizes=HEADS, direct=st.booleans())
def test_an_unhashed_upload_landed_in_any_sizes_is_the_one_written(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], direct: bool
) -> None:
    folder = tmp_path_factory.mktemp("unhashed")
    body = unhashed_body(TENSORS)
    written, landed = (unhashed_receiver(folder / name, len(body), direct) for name in ("written", "landed"))
    written.write(body)
    in_place = land(landed, body, sizes)
    first, second = written.finish(), landed.finish()
    assert second.digests == first.digests == [tensor_digest(t.dtype, t.shape, t.data) for t in TENSORS]
    assert (folder / "landed").read_bytes() == (folder / "written").read_bytes()
    assert in_place > 0


def test_an_unhashed_upload_of_equal_tensors_landed_in_place_is_refused(tmp_path: Path) -> None:
    body = unhashed_body([TENSORS[2], TENSORS[1], TENSORS[2]])
    receiver = unhashed_receiver(tmp_path / "u", len(body))
    with pytest.raises(InvalidInputError, match="are equal"):
        land(receiver, body, [BUFFER_BYTES])
    receiver.discard()
    assert not (tmp_path / "u").exists()


operations = st.lists(st.tuples(st.booleans(), st.integers(1, BUFFER_BYTES + ALIGNMENT)), min_size=1, max_size=8)


@SETTINGS
@given(steps=operations, direct=st.booleans(), in_flight=st.sampled_from([0, 2]))
def test_bytes_put_into_the_space_and_bytes_written_make_one_exact_file(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[bool, int]], direct: bool, in_flight: int
) -> None:
    path = tmp_path_factory.mktemp("writer") / "f"
    data = os.urandom(sum(size for _, size in steps))
    writer = DirectFileWriter(path, direct=direct, in_flight=in_flight)
    done = 0
    for in_place, size in steps:
        if not in_place:
            writer.write(data[done : done + size])
            done += size
            continue
        end = done + size
        while done < end:
            space = writer.space()
            take = min(space.nbytes, end - done)
            space[:take] = data[done : done + take]
            del space
            writer.advance(take)
            done += take
    writer.close()
    assert writer.size == len(data) and path.read_bytes() == data


@pytest.mark.parametrize("nbytes", [0, -1, BUFFER_BYTES - 99])
def test_advancing_by_nothing_or_past_the_space_is_refused(tmp_path: Path, nbytes: int) -> None:
    writer = DirectFileWriter(tmp_path / "f")
    writer.write(b"x" * 100)
    with pytest.raises(ValueError, match="do not fit"):
        writer.advance(nbytes)
    writer.close()
    assert (tmp_path / "f").read_bytes() == b"x" * 100
