"""``torch.save`` files whose tensors clone one storage many times, whose zip entries share or overlap regions,
whose pickles make work before they are bounded, or whose storage keys are malformed.

Each case is refused in its own process within :data:`~tests.cli.hostile_case.WITHIN_S` seconds and
:data:`~tests.cli.hostile_case.MAX_RSS_MIB` MiB peak RSS (``isolated=True, within_s=WITHIN_S,
max_rss_mib=MAX_RSS_MIB``).

The archives are written by hand (:func:`raw_zip`): local headers, central directory and end record
packed field by field, so an entry may point wherever the case needs and a header may sit inside
another member's bytes.
"""

from __future__ import annotations

import collections
import io
import pickle  # noqa: TID251 - making the hostile files under test
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.cli.hostile_case import LIMIT, MAX_RSS_MIB, OVERLAP, WITHIN_S, Case, Says

NAME = "weights.pt"
#: Bytes of the one storage the amplifying files reuse (the file is about this size).
STORAGE_BYTES = 16 << 20
#: Tensors, or archive entries, over it: each would make :data:`STORAGE_BYTES` more.
COPIES = 400

_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_END = struct.Struct("<4s4H2LH")


@dataclass
class Member:
    """A local header followed by ``data``; ``size`` (if set) is what the headers record instead of
    ``len(data)``, so a member may claim bytes that lie after it. ``pad``: extra-field bytes (0 or 4+)."""

    name: str
    data: bytes = b""
    size: int | None = None
    pad: int = 0
    offset: int = 0

    @property
    def recorded(self) -> int:
        return len(self.data) if self.size is None else self.size

    @property
    def crc(self) -> int:
        return zlib.crc32(self.data) if self.size is None else 0

    def header(self) -> bytes:
        extra = struct.pack("<HH", 0xCAFE, self.pad - 4) + bytes(self.pad - 4) if self.pad else b""
        name = self.name.encode()
        fields = (b"PK\x03\x04", 20, 0, 0, 0, 0, 0, self.crc, self.recorded, self.recorded, len(name), len(extra))
        return _LOCAL.pack(*fields) + name + extra

    @property
    def data_at(self) -> int:
        return self.offset + len(self.header())


def layout(pieces: list[Member | bytes], start: int = 0) -> int:
    """Give each member of ``pieces`` (members and raw bytes, in file order) its offset; the end."""
    at = start
    for piece in pieces:
        if isinstance(piece, Member):
            piece.offset = at
            at += len(piece.header()) + len(piece.data)
        else:
            at += len(piece)
    return at


def raw_zip(path: Path, pieces: list[Member | bytes], central: list[tuple[str, Member]]) -> Path:
    """A stored zip of ``pieces`` in order, then a central directory of ``(name, member it points at)``."""
    out = bytearray()
    layout(pieces)
    for piece in pieces:
        out += piece.header() + piece.data if isinstance(piece, Member) else piece
    directory = bytearray()
    for name, member in central:
        raw = name.encode()
        directory += _CENTRAL.pack(
            b"PK\x01\x02", 20, 20, 0, 0, 0, 0, member.crc, member.recorded, member.recorded, len(raw), 0, 0, 0, 0,
            0, member.offset,
        ) + raw  # fmt: skip
    end = _END.pack(b"PK\x05\x06", 0, 0, len(central), len(central), len(directory), len(out), 0)
    path.write_bytes(bytes(out + directory + end))
    return path


class StorageRef:
    """A storage record, pickled by persistent id as torch writes one."""

    def __init__(self, key: str, numel: int, kind: Any) -> None:
        self.key, self.numel, self.kind = key, numel, kind


class TensorRef:
    """A contiguous tensor over ``storage`` from element ``offset``: ``_rebuild_tensor_v3`` when ``dtype`` is given
    (how torch writes a tensor over an untyped storage), else ``_rebuild_tensor_v2``."""

    def __init__(self, storage: StorageRef, numel: int, dtype: torch.dtype | None = None, offset: int = 0) -> None:
        self.storage, self.numel, self.dtype, self.offset = storage, numel, dtype, offset

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        args = (self.storage, self.offset, (self.numel,), (1,), False, collections.OrderedDict())
        if self.dtype is None:
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, (*args, self.dtype)


class _Pickler(pickle.Pickler):  # noqa: TID251 - making the hostile file under test
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None


def tensors_pickle(value: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(value)
    return buffer.getvalue()


def archive(path: Path, data_pkl: bytes, storages: list[Member], central_storages: list[tuple[str, Member]]) -> Path:
    """``data.pkl``, ``byteorder`` and ``version`` members around the case's own storage members."""
    pkl, order, version = (
        Member("archive/data.pkl", data_pkl),
        Member("archive/byteorder", b"little"),
        Member("archive/version", b"3\n"),
    )
    central = [("archive/data.pkl", pkl), ("archive/byteorder", order), *central_storages, ("archive/version", version)]
    return raw_zip(path, [pkl, order, *storages, version], central)


def one_storage(path: Path, data_pkl: bytes, data: bytes, at: int = 0) -> Path:
    """An archive whose one storage, ``data/0``, holds ``data`` from a file offset of ``at`` modulo 64
    (1: misaligned for every dtype wider than a byte)."""
    pkl, order = Member("archive/data.pkl", data_pkl), Member("archive/byteorder", b"little")
    member = Member("archive/data/0", data, pad=4)
    layout([pkl, order, member])
    member.pad += (at - member.data_at) % 64
    layout([pkl, order, member])
    assert member.data_at % 64 == at % 64
    return archive(path, data_pkl, [member], [("archive/data/0", member)])


def misaligned_clones(work: Path) -> Path:
    """:data:`COPIES` float32 tensors (``_rebuild_tensor_v3``) over one untyped storage whose bytes start at an
    odd offset: each would be a copy of its own of the whole storage, 16 MiB × 400 from a 16 MiB file."""
    storage = StorageRef("0", STORAGE_BYTES, torch.UntypedStorage)
    data_pkl = tensors_pickle({f"w{i}": TensorRef(storage, STORAGE_BYTES // 4, torch.float32) for i in range(COPIES)})
    return one_storage(work / NAME, data_pkl, bytes(range(256)) * (STORAGE_BYTES // 256), at=1)


def shared_header(work: Path) -> Path:
    """:data:`COPIES` central-directory entries (``data/0`` … ``data/399``) pointing at one local header of a
    16 MiB storage, each the storage of a tensor of its own."""
    data_pkl = tensors_pickle(
        {
            f"w{i}": TensorRef(StorageRef(str(i), STORAGE_BYTES // 4, torch.FloatStorage), STORAGE_BYTES // 4)
            for i in range(COPIES)
        }
    )
    member = Member("archive/data/0", bytes(STORAGE_BYTES))
    return archive(work / NAME, data_pkl, [member], [(f"archive/data/{i}", member) for i in range(COPIES)])


def overlapping_members(work: Path) -> Path:
    """:data:`COPIES` members whose local headers follow one another, each member's bytes running over the
    headers after it to the end of one 16 MiB run: every member a distinct header, all overlapping."""
    chain = [Member(f"archive/data/{i}") for i in range(COPIES)]
    bulk = bytes(STORAGE_BYTES)
    end = layout([*chain, bulk])
    for member in chain:
        member.size = end - member.data_at
    storages = [StorageRef(str(i), m.recorded, torch.ByteStorage) for i, m in enumerate(chain)]
    data_pkl = tensors_pickle({f"w{i}": TensorRef(s, s.numel) for i, s in enumerate(storages)})
    pkl, order, version = (
        Member("archive/data.pkl", data_pkl),
        Member("archive/byteorder", b"little"),
        Member("archive/version", b"3\n"),
    )
    central = [("archive/data.pkl", pkl), ("archive/byteorder", order), *((m.name, m) for m in chain)]
    return raw_zip(work / NAME, [*chain, bulk, pkl, order, version], [*central, ("archive/version", version)])


def reference_bomb(levels: int = 40) -> bytes:
    """A list ``x = [x, x]`` ``levels`` times by memo reference: a few bytes per level, 2**levels parts."""
    out = bytearray(b"]q\x00")
    for level in range(1, levels + 1):
        out += b"0]q" + bytes([level]) + b"(h" + bytes([level - 1]) + b"h" + bytes([level - 1]) + b"e"
    return bytes(out)


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def bomb_storage_key(work: Path) -> Path:
    """A ~1 KB archive whose tensor's persistent id names its storage by a reference bomb instead of a string:
    any message that formats the key walks 2**40 lists."""
    pid = b"(" + _unicode("storage") + b"ctorch\nFloatStorage\n" + reference_bomb() + _unicode("cpu") + b"K\x04t"
    data_pkl = b"\x80\x02}" + _unicode("w") + pid + b"Qs."
    return archive(work / NAME, data_pkl, [], [])


def deep_tuple_key(work: Path, depth: int = 1_000_000) -> Path:
    """A dict keyed by a tuple nested a million deep (``TUPLE1`` repeated): hashing it recurses a million
    levels in C."""
    data_pkl = b"\x80\x02}" + b")" + b"\x85" * depth + b"Ns."
    return archive(work / NAME, data_pkl, [], [])


def legacy_key_list(work: Path) -> Path:
    """A legacy (pre-zip) file whose list of storage keys is ``[1, "0"]``: one key is not a string."""
    parts = [
        pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2),
        pickle.dumps(1001, protocol=2),
        pickle.dumps({"protocol_version": 1001, "little_endian": True, "type_sizes": {"int": 4}}, protocol=2),
        tensors_pickle({"w": TensorRef(StorageRef("0", 4, torch.FloatStorage), 4)}),
        pickle.dumps([1, "0"], protocol=2),
        struct.pack("<q", 4) + bytes(16),
    ]
    path = work / NAME
    path.write_bytes(b"".join(parts))
    return path


def _case(case_id: str, build: Any, says: Says) -> Case:
    return Case(case_id, build, NAME, says, isolated=True, within_s=WITHIN_S, max_rss_mib=MAX_RSS_MIB)


CASES: list[Case] = [
    _case("pt-v3-misaligned-clones", misaligned_clones, LIMIT),
    _case("pt-zip-shared-header", shared_header, (("share", "shares", "overlap", "reuse"),)),
    _case("pt-zip-overlapping-members", overlapping_members, OVERLAP),
    _case("pt-bomb-storage-key", bomb_storage_key, ("storage", "key")),
    _case("pt-deep-tuple-key", deep_tuple_key, ("key", ("deep", "depth"))),
    _case("pt-legacy-key-list", legacy_key_list, ("storage", "list")),
]
