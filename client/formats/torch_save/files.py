"""``torch.save`` files (zip and legacy) read by :mod:`client.formats.pickled.reader`, never by torch.load.

A zip archive (``torch.save`` since 1.6) holds ``<dir>/data.pkl`` and one stored (never
compressed) member per storage; its tensors are views of the mapped file. A legacy file is a
run of pickles followed by each storage's bytes. Either way a pickle may name only the
constructors below: tensors (``_rebuild_tensor_v2`` over a storage of the file), ``OrderedDict``,
``torch.Size``, dtypes, sets, ``_codecs.encode``, and, for RNG state, numpy arrays and scalars
of plain numeric dtypes.

Every tensor is checked against the bytes behind it (:mod:`client.formats.torch_save.constructors`);
each storage must be a stored member (or legacy record) of exactly its size, inside the file.
An archive's members must be distinct regions (:mod:`client.formats.torch_save.zip_members`), checked
before any is read, so the file's bytes are each read once; what its tensors make is charged to
the import's budget as they are made. Every field is checked by type before it is used: a
malformed file is one :class:`InvalidInputError` naming it, never a traceback.
"""

from __future__ import annotations

import io
import mmap
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from ckptstore.client.formats import confined
from ckptstore.client.formats.pickled.allowlist import PickleLimits, shown
from ckptstore.client.formats.pickled.reader import read_pickle
from ckptstore.client.formats.pickled.tree import finish_value
from ckptstore.client.formats.torch_save.constructors import MAX_STORAGES, Storage, TorchFile, itemsize
from ckptstore.client.formats.torch_save.zip_members import ZIP_MAGIC, Region, member_regions
from ckptstore.service.errors import InvalidInputError

#: The largest ``data.pkl`` (or legacy pickle) read: the structure, not the tensors' bytes.
MAX_PICKLE_BYTES = 256 << 20
#: Most members of one zip archive.
MAX_MEMBERS = 1 << 20
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
#: What a malformed field can raise where it is used; each becomes an InvalidInputError naming the file.
_MALFORMED = (TypeError, KeyError, ValueError, IndexError, AttributeError, OverflowError, struct.error, RuntimeError)


def read_torch_file(path: Path, *, numpy_arrays: bool = False, expand_limit: int = 0) -> Any:
    """The object ``torch.save`` wrote to ``path``, its tensors views of the mapped file.

    Raises:
        InvalidInputError: not a file ``torch.save`` writes, a compressed member, a global
            outside the allow-list, a limit passed (see :mod:`client.formats.pickled.reader`).
    """
    mapped = confined.map_file(path)
    if mapped is None:
        raise InvalidInputError(f"{path}: the file is empty, not a file torch.save writes")
    return read_torch_bytes(
        mapped, 0, len(mapped), where=str(path), numpy_arrays=numpy_arrays, expand_limit=expand_limit
    )


def read_torch_bytes(
    mapped: mmap.mmap | bytes,
    start: int,
    length: int,
    *,
    where: str,
    numpy_arrays: bool = False,
    expand_limit: int = 0,
) -> Any:
    """The object ``torch.save`` wrote to ``mapped[start:start + length]`` (a file, or an item of a DCP file)."""
    reader = TorchFile(where, expand_limit=expand_limit, numpy_arrays=numpy_arrays)
    head = bytes(mapped[start : start + 4])
    try:
        if head == ZIP_MAGIC:
            return _read_zip(reader, mapped, start, length)
        if head[:1] == b"\x80":
            return _read_legacy(reader, mapped, start, length)
    except InvalidInputError as exc:
        if str(exc).startswith(where):
            raise
        raise InvalidInputError(f"{where}: {exc}") from None  # a constructor's words: the file named first
    except _MALFORMED as exc:  # a field of a type or value no check above foresaw: still the file's fault
        said = exc.args[0][:120] if len(exc.args) == 1 and type(exc.args[0]) is str else ""
        raise InvalidInputError(
            f"{where}: not a file torch.save writes ({type(exc).__name__}{': ' + said if said else ''})"
        ) from None
    raise InvalidInputError(f"{where}: not a file torch.save writes (neither a zip archive nor a pickle)")


class _Window(io.RawIOBase):
    """A read-only, seekable file over ``buffer[start:start + length]`` (for :mod:`zipfile`)."""

    def __init__(self, buffer: mmap.mmap | bytes, start: int, length: int) -> None:
        self.buffer, self.start, self.length, self.at = buffer, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = max(0, [offset, self.at + offset, self.length + offset][whence])
        return self.at

    def tell(self) -> int:
        return self.at

    def readinto(self, target: Any) -> int:
        end = min(self.length, self.at + len(target))
        count = max(0, end - self.at)
        target[:count] = self.buffer[self.start + self.at : self.start + self.at + count]
        self.at += count
        return count


def _flat(mapped: mmap.mmap | bytes, start: int, storage: Storage) -> torch.Tensor:
    """The storage's bytes at ``start`` of ``mapped``, as a 1-D tensor of its dtype (a view where aligned)."""
    size = itemsize(storage.dtype)
    if storage.nbytes == 0:
        return torch.empty(0, dtype=storage.dtype)
    if isinstance(mapped, mmap.mmap) and start % size == 0:
        raw = torch.frombuffer(mapped, dtype=torch.uint8, offset=start, count=storage.nbytes)
    else:  # misaligned for its dtype, or bytes in memory: a copy of its own
        raw = torch.frombuffer(bytearray(mapped[start : start + storage.nbytes]), dtype=torch.uint8)
    return raw.view(storage.dtype)


def _read_zip(reader: TorchFile, mapped: mmap.mmap | bytes, start: int, length: int) -> Any:
    try:
        archive = zipfile.ZipFile(_Window(mapped, start, length))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error, NotImplementedError) as exc:
        raise InvalidInputError(f"{reader.where}: not a zip archive torch.save writes ({str(exc)[:200]})") from exc
    if len(members) > MAX_MEMBERS:
        raise InvalidInputError(f"{reader.where}: {len(members)} archive members, past the limit of {MAX_MEMBERS}")
    by_name: dict[str, zipfile.ZipInfo] = {}
    for member in members:
        if by_name.setdefault(member.filename, member) is not member:
            raise InvalidInputError(
                f"{reader.where}: archive member {shown(member.filename, 80)} is listed twice, which torch.save "
                "never writes"
            )
    regions = member_regions(reader.where, members, mapped, start, length)  # before any member is read
    pickles = [m.filename for m in members if m.filename.endswith("/data.pkl") and m.filename.count("/") == 1]
    if len(pickles) != 1:
        raise InvalidInputError(f"{reader.where}: not an archive torch.save writes (no single <name>/data.pkl)")
    prefix = pickles[0][: -len("data.pkl")]
    order = by_name.get(prefix + "byteorder")
    if order is not None and _member(reader, mapped, start, order, regions).tobytes() != b"little":
        raise InvalidInputError(f"{reader.where}: a big-endian archive, which ckptstore does not read")
    data = _member(reader, mapped, start, by_name[pickles[0]], regions)
    if len(data) > MAX_PICKLE_BYTES:
        raise InvalidInputError(
            f"{reader.where}: data.pkl of {len(data)} bytes is past the limit of {MAX_PICKLE_BYTES}"
        )
    value, _ = read_pickle(
        data,
        where=reader.where,
        globals_=reader.globals_table(),
        persistent_load=reader.persistent_load,
        limits=PickleLimits(max_bytes=MAX_PICKLE_BYTES),
        finish=False,
    )
    for key, storage in reader.storages.items():
        found = by_name.get(f"{prefix}data/{key}")
        if found is None:
            raise InvalidInputError(f"{reader.where}: storage {shown(key)} has no bytes in the archive")
        region = _stored(reader, found, regions)
        if region.size != storage.nbytes:
            raise InvalidInputError(
                f"{reader.where}: storage {shown(key)} claims {storage.nbytes} bytes; the archive holds {region.size}"
            )
        storage.flat = _flat(mapped, start + region.data_at, storage)
    return finish_value(value, where=reader.where)


def _stored(reader: TorchFile, member: zipfile.ZipInfo, regions: dict[str, Region]) -> Region:
    """``member``'s region (checked by :func:`member_regions`), once it is stored, not compressed."""
    if member.compress_type != zipfile.ZIP_STORED or member.compress_size != member.file_size:
        raise InvalidInputError(
            f"{reader.where}: archive member {shown(member.filename, 80)} is compressed; torch.save never "
            "compresses, and ckptstore does not inflate archives"
        )
    return regions[member.filename]


def _member(
    reader: TorchFile, mapped: mmap.mmap | bytes, start: int, member: zipfile.ZipInfo, regions: dict[str, Region]
) -> memoryview:
    region = _stored(reader, member, regions)
    return memoryview(mapped)[start + region.data_at : start + region.end]


def _read_legacy(reader: TorchFile, mapped: mmap.mmap | bytes, start: int, length: int) -> Any:
    """A legacy file: magic, protocol and system pickles, the object, the storage keys, then each storage's bytes."""
    view = memoryview(mapped)[start : start + length]
    small = PickleLimits(max_bytes=1 << 20, max_items=1 << 16)
    limits = PickleLimits(max_bytes=MAX_PICKLE_BYTES)
    at = 0
    magic, at = read_pickle(view, where=reader.where, globals_={}, limits=small, start=at)
    if type(magic) is not int or magic != _LEGACY_MAGIC:
        raise InvalidInputError(f"{reader.where}: a pickle, not a file torch.save writes (no torch magic number)")
    protocol, at = read_pickle(view, where=reader.where, globals_={}, limits=small, start=at)
    info, at = read_pickle(view, where=reader.where, globals_={}, limits=small, start=at)
    if type(protocol) is not int or protocol != _LEGACY_PROTOCOL or type(info) is not dict:
        raise InvalidInputError(f"{reader.where}: a legacy torch.save file of a kind ckptstore does not read")
    if info.get("little_endian") is not True:
        raise InvalidInputError(f"{reader.where}: a legacy torch.save file of a kind ckptstore does not read")
    value, at = read_pickle(
        view,
        where=reader.where,
        globals_=reader.globals_table(),
        persistent_load=reader.persistent_load,
        limits=limits,
        start=at,
        finish=False,
    )
    keys, at = read_pickle(view, where=reader.where, globals_={}, limits=small, start=at)
    for key in _storage_keys(reader, keys):
        storage = reader.storages[key]
        confined.check_region(reader.where, at, 8, length, f"storage {shown(key)}")
        (count,) = struct.unpack("<q", view[at : at + 8])
        if count != storage.numel:
            raise InvalidInputError(f"{reader.where}: storage {shown(key)} holds {count} elements, not {storage.numel}")
        confined.check_region(reader.where, at + 8, storage.nbytes, length, f"storage {shown(key)}")
        storage.flat = _flat(mapped, start + at + 8, storage)
        at += 8 + storage.nbytes
    return finish_value(value, where=reader.where)


def _storage_keys(reader: TorchFile, keys: Any) -> list[str]:
    """A legacy file's storage list, once it is a list of distinct string keys naming exactly the storages
    its tensors use (each storage's bytes follow in that order)."""
    if type(keys) is not list or len(keys) > MAX_STORAGES:
        raise InvalidInputError(
            f"{reader.where}: the legacy file's storage list is {shown(keys)}, not a list of at most "
            f"{MAX_STORAGES} keys"
        )
    for key in keys:
        if type(key) is not str:
            raise InvalidInputError(
                f"{reader.where}: the legacy file's storage list holds {shown(key)}, not a string key"
            )
    if len(set(keys)) != len(keys) or set(keys) != reader.storages.keys():
        raise InvalidInputError(f"{reader.where}: the legacy file's storage list does not match its tensors")
    return keys
