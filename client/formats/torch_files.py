"""``torch.save`` files (zip and legacy) read by :mod:`client.formats.pickle_reader`, never by torch.load.

A zip archive (``torch.save`` since 1.6) holds ``<dir>/data.pkl`` and one stored (never
compressed) member per storage; its tensors are views of the mapped file. A legacy file is a
run of pickles followed by each storage's bytes. Either way a pickle may name only the
constructors below: tensors (``_rebuild_tensor_v2`` over a storage of the file), ``OrderedDict``,
``torch.Size``, dtypes, sets, ``_codecs.encode``, and, for RNG state, numpy arrays and scalars
of plain numeric dtypes.

Every tensor is checked against the bytes behind it before it is made: in bounds of its
storage, no negative strides, and no more bytes than the storage holds (a stride-0
``expand`` or an overlapping view claims more than it has). Such a tensor is kept as a
:class:`RefusedTensor`, which the importer reports under its state_dict key; ``expand_limit``
lets views claiming up to that many bytes through.
"""

from __future__ import annotations

import io
import mmap
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from client.formats import confined
from client.formats.pickle_reader import Built, Global, GlobalTable, PickleLimits, finish_value, read_pickle
from service.errors import InvalidInputError

#: The largest ``data.pkl`` (or legacy pickle) read: the structure, not the tensors' bytes.
MAX_PICKLE_BYTES = 256 << 20
#: Most storages one file may hold.
MAX_STORAGES = 1 << 20
#: Most members of one zip archive.
MAX_MEMBERS = 1 << 20
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "double",
        "float",
        "half",
        "long",
        "int",
        "short",
        "cfloat",
        "cdouble",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_STORAGE_TYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
    "UntypedStorage": torch.uint8,
}
_NUMPY_KINDS = {"b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "?"}


@dataclass(frozen=True)
class StorageType:
    """A storage class a pickle names (``torch.FloatStorage``): only its dtype."""

    dtype: torch.dtype


@dataclass
class Storage:
    """One storage of the file: its dtype, element count and, once bound, its bytes as a tensor."""

    key: str
    dtype: torch.dtype
    numel: int
    flat: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds."""
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class RefusedTensor:
    """A tensor that could not be made over its bytes; ``reason`` says why (the key is the caller's)."""

    reason: str


class _TensorRecord(Built):
    """``_rebuild_tensor_v2``'s arguments, checked; made into a view at the end of the read."""

    def __init__(
        self, storage: Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...], expand_limit: int
    ):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.expand_limit = expand_limit

    def result(self) -> Any:
        numel = 1
        for dim in self.size:
            numel *= dim
        itemsize = _itemsize(self.storage.dtype)
        extent = self.offset + sum((d - 1) * s for d, s in zip(self.size, self.stride, strict=True)) + 1
        if numel and extent > self.storage.numel:
            return RefusedTensor(
                f"reaches element {extent} of a storage of {self.storage.numel} elements: it lies past its bytes"
            )
        claimed = numel * itemsize
        if claimed > self.storage.nbytes and claimed > self.expand_limit:
            return RefusedTensor(
                f"claims {claimed} bytes ({list(self.size)} x {itemsize}) over a storage of "
                f"{self.storage.nbytes} bytes "
                "(an expanded view that repeats its bytes); save it with .contiguous(), or allow expanded tensors "
                "up to a size with --allow-expanded"
            )
        if self.storage.flat is None:
            raise InvalidInputError(f"storage {self.storage.key} has no bytes in the file")
        return torch.as_strided(self.storage.flat, self.size, self.stride, self.offset)


class _NumpyArray(Built):
    """``numpy.core.multiarray._reconstruct(ndarray, ...)`` finished by ``BUILD``: a numeric array."""

    def __init__(self) -> None:
        self.value: Any = None

    def build(self, state: Any) -> None:
        import numpy

        if self.value is not None or not isinstance(state, tuple) or len(state) != 5:
            raise InvalidInputError("a numpy array's state is not (version, shape, dtype, fortran, bytes)")
        _, shape, dtype, fortran, raw = state
        if not isinstance(dtype, _NumpyDtype) or not isinstance(raw, (bytes, bytearray)) or fortran not in (0, 1):
            raise InvalidInputError("a numpy array holds something other than numbers in its bytes")
        shape = _dims(shape, "a numpy array's shape")
        count = 1
        for dim in shape:
            count *= dim
        kind = dtype.numpy()
        if count * kind.itemsize != len(raw):
            raise InvalidInputError(
                f"a numpy array of shape {list(shape)} has {len(raw)} bytes, not {count * kind.itemsize}"
            )
        self.value = numpy.frombuffer(bytes(raw), dtype=kind).reshape(shape, order="F" if fortran else "C").copy()

    def result(self) -> Any:
        if self.value is None:
            raise InvalidInputError("a numpy array is never given its bytes")
        return self.value


class _NumpyDtype(Built):
    """``numpy.dtype(kind, align, copy)``; ``BUILD`` gives its byte order."""

    def __init__(self, kind: Any) -> None:
        if not isinstance(kind, str) or kind.lstrip("<>|=") not in _NUMPY_KINDS:
            raise InvalidInputError(f"numpy dtype {str(kind)[:40]!r} is not a plain numeric type")
        self.kind, self.order = kind, "<"

    def build(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">", "|", "="):
            self.order = state[1]
        else:
            raise InvalidInputError("a numpy dtype's state is not one numpy writes")

    def numpy(self) -> Any:
        import numpy

        return numpy.dtype(self.order.replace("|", "=") + self.kind.lstrip("<>|="))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > 64 or not all(type(d) is int and 0 <= d < 1 << 62 for d in value):
        raise InvalidInputError(f"{what} is not a tuple of at most 64 non-negative integers")
    return value


def _check_args(args: tuple[Any, ...], count: int, what: str) -> tuple[Any, ...]:
    if len(args) < count:
        raise InvalidInputError(f"{what} is given {len(args)} arguments, not {count}")
    return args


@dataclass
class TorchFile:
    """What the reader of one file needs: where it is, its storages and its options."""

    where: str
    storages: dict[str, Storage] = field(default_factory=dict)
    expand_limit: int = 0
    numpy_arrays: bool = False

    def persistent_load(self, pid: Any) -> Storage:
        """The storage a persistent id names: ``('storage', StorageType, key, location, numel[, view])``."""
        if not isinstance(pid, tuple) or len(pid) not in (5, 6) or pid[0] != "storage":
            raise InvalidInputError(f"{self.where}: a persistent id that is not a storage of this file")
        storage_type, key, _, numel = pid[1:5]
        if not isinstance(storage_type, StorageType) or not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise InvalidInputError(f"{self.where}: storage {str(key)[:40]!r} is described with the wrong types")
        if len(pid) == 6 and pid[5] is not None:
            raise InvalidInputError(
                f"{self.where}: storage {key[:40]!r} is a view of another storage, which is not read"
            )
        known = self.storages.get(key)
        if known is not None:
            if known.dtype != storage_type.dtype or known.numel != numel:
                raise InvalidInputError(f"{self.where}: storage {key[:40]!r} is described twice, differently")
            return known
        if len(self.storages) >= MAX_STORAGES:
            raise InvalidInputError(f"{self.where}: more than {MAX_STORAGES} storages, past the limit")
        self.storages[key] = Storage(key, storage_type.dtype, numel)
        return self.storages[key]

    def rebuild_tensor(self, args: tuple[Any, ...]) -> _TensorRecord:
        """``_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])``, checked."""
        storage, offset, size, stride = _check_args(args, 4, "a tensor")[:4]
        if not isinstance(storage, Storage) or type(offset) is not int or offset < 0:
            raise InvalidInputError(f"{self.where}: a tensor without a storage of this file or with a bad offset")
        size, stride = _dims(size, "a tensor's size"), _dims(stride, "a tensor's strides")
        if len(size) != len(stride):
            raise InvalidInputError(f"{self.where}: a tensor's size and strides differ in length")
        hooks = args[5] if len(args) > 5 else None
        if hooks is not None and hooks != {}:
            raise InvalidInputError(f"{self.where}: a tensor with backward hooks, which ckptstore never runs")
        return _TensorRecord(storage, offset, size, stride, self.expand_limit)

    def globals_table(self) -> GlobalTable:
        """What this file's pickles may name."""
        table: dict[tuple[str, str], Any] = {
            ("collections", "OrderedDict"): Global("OrderedDict", call=_ordered_dict),
            ("torch._utils", "_rebuild_tensor_v2"): Global("tensor", call=self.rebuild_tensor),
            ("torch._utils", "_rebuild_tensor"): Global("tensor", call=self.rebuild_tensor),
            ("torch._utils", "_rebuild_parameter"): Global("parameter", call=_parameter),
            ("torch", "Size"): Global(
                "torch.Size", call=lambda args: _dims(_check_args(args, 1, "torch.Size")[0], "a torch.Size")
            ),
            ("_codecs", "encode"): Global("bytes", call=_codecs_encode),
        }
        table.update({("torch", name): dtype for name, dtype in _DTYPES.items()})
        table.update({("torch", name): StorageType(dtype) for name, dtype in _STORAGE_TYPES.items()})
        for module in ("builtins", "__builtin__"):
            table[(module, "set")] = Global("set", call=lambda args: set(_check_args(args, 1, "set")[0]))
            table[(module, "frozenset")] = Global(
                "frozenset", call=lambda args: frozenset(_check_args(args, 1, "set")[0])
            )
            table[(module, "bytes")] = Global("bytes", call=_empty_bytes)
        if self.numpy_arrays:
            for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
                table[(module, "_reconstruct")] = Global("numpy array", call=lambda args: _NumpyArray())
                table[(module, "scalar")] = Global("numpy scalar", call=_numpy_scalar)
            table[("numpy", "ndarray")] = Global("numpy.ndarray")
            table[("numpy", "dtype")] = Global(
                "numpy.dtype", call=lambda args: _NumpyDtype(_check_args(args, 1, "dtype")[0])
            )
        return table


def _ordered_dict(args: tuple[Any, ...]) -> dict[Any, Any]:
    if args not in ((), ([],)):
        raise InvalidInputError("an OrderedDict is made with arguments")
    return {}


def _parameter(args: tuple[Any, ...]) -> Any:
    data = _check_args(args, 1, "a parameter")[0]
    if not isinstance(data, _TensorRecord):
        raise InvalidInputError("a parameter that holds no tensor")
    return data


def _empty_bytes(args: tuple[Any, ...]) -> bytes:
    """``bytes()``: how protocols 0-2 write an empty bytes object."""
    if args:
        raise InvalidInputError("bytes is made with arguments")
    return b""


def _codecs_encode(args: tuple[Any, ...]) -> bytes:
    text, encoding = _check_args(args, 2, "_codecs.encode")[:2]
    if not isinstance(text, str) or encoding != "latin1":
        raise InvalidInputError("_codecs.encode is asked for something other than latin1 bytes")
    return text.encode("latin1")


def _numpy_scalar(args: tuple[Any, ...]) -> Any:
    import numpy

    dtype, raw = _check_args(args, 2, "a numpy scalar")[:2]
    if not isinstance(dtype, _NumpyDtype) or not isinstance(raw, (bytes, bytearray)):
        raise InvalidInputError("a numpy scalar that is not a number")
    kind = dtype.numpy()
    if len(raw) != kind.itemsize:
        raise InvalidInputError(f"a numpy scalar of {len(raw)} bytes for a {kind} ({kind.itemsize} bytes)")
    return numpy.frombuffer(bytes(raw), dtype=kind)[0]


# -- the two layouts -------------------------------------------------------------------------


def read_torch_file(path: Path, *, numpy_arrays: bool = False, expand_limit: int = 0) -> Any:
    """The object ``torch.save`` wrote to ``path``, its tensors views of the mapped file.

    Raises:
        InvalidInputError: not a file ``torch.save`` writes, a compressed member, a global
            outside the allow-list, a limit passed (see :mod:`client.formats.pickle_reader`).
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
    if head == _ZIP_MAGIC:
        return _read_zip(reader, mapped, start, length)
    if head[:1] == b"\x80":
        return _read_legacy(reader, mapped, start, length)
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
    itemsize = _itemsize(storage.dtype)
    if storage.nbytes == 0:
        return torch.empty(0, dtype=storage.dtype)
    if isinstance(mapped, mmap.mmap) and start % itemsize == 0:
        raw = torch.frombuffer(mapped, dtype=torch.uint8, offset=start, count=storage.nbytes)
    else:  # misaligned for its dtype, or bytes in memory: a copy of its own
        raw = torch.frombuffer(bytearray(mapped[start : start + storage.nbytes]), dtype=torch.uint8)
    return raw.view(storage.dtype)


def _read_zip(reader: TorchFile, mapped: mmap.mmap | bytes, start: int, length: int) -> Any:
    try:
        archive = zipfile.ZipFile(_Window(mapped, start, length))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error, NotImplementedError) as exc:
        raise InvalidInputError(f"{reader.where}: not a zip archive torch.save writes ({exc})") from exc
    if len(members) > MAX_MEMBERS:
        raise InvalidInputError(f"{reader.where}: {len(members)} archive members, past the limit of {MAX_MEMBERS}")
    by_name = {m.filename: m for m in members}
    pickles = [m.filename for m in members if m.filename.endswith("/data.pkl") and m.filename.count("/") == 1]
    if len(pickles) != 1:
        raise InvalidInputError(f"{reader.where}: not an archive torch.save writes (no single <name>/data.pkl)")
    prefix = pickles[0][: -len("data.pkl")]
    order = by_name.get(prefix + "byteorder")
    if order is not None and _member(reader, mapped, start, length, order).tobytes() != b"little":
        raise InvalidInputError(f"{reader.where}: a big-endian archive, which ckptstore does not read")
    data = _member(reader, mapped, start, length, by_name[pickles[0]])
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
        member = by_name.get(f"{prefix}data/{key}")
        if member is None:
            raise InvalidInputError(f"{reader.where}: storage {key[:40]!r} has no bytes in the archive")
        region = _member_offset(reader, mapped, start, length, member)
        if member.file_size != storage.nbytes:
            raise InvalidInputError(
                f"{reader.where}: storage {key[:40]!r} claims {storage.nbytes} bytes; the archive holds "
                f"{member.file_size}"
            )
        storage.flat = _flat(mapped, start + region, storage)
    return finish_value(value, where=reader.where)


def _member_offset(
    reader: TorchFile, mapped: mmap.mmap | bytes, start: int, length: int, member: zipfile.ZipInfo
) -> int:
    """Where ``member``'s bytes start (relative to ``start``), once they are stored and inside the archive."""
    if member.compress_type != zipfile.ZIP_STORED or member.compress_size != member.file_size:
        raise InvalidInputError(
            f"{reader.where}: archive member {member.filename[:80]!r} is compressed; torch.save never compresses, "
            "and ckptstore does not inflate archives"
        )
    header_at = member.header_offset
    confined.check_region(reader.where, header_at, _LOCAL_HEADER.size, length, f"member {member.filename[:80]!r}")
    fields = _LOCAL_HEADER.unpack(bytes(mapped[start + header_at : start + header_at + _LOCAL_HEADER.size]))
    if fields[0] != _ZIP_MAGIC:
        raise InvalidInputError(f"{reader.where}: archive member {member.filename[:80]!r} has no local header")
    data_at = header_at + _LOCAL_HEADER.size + fields[10] + fields[11]
    confined.check_region(reader.where, data_at, member.file_size, length, f"member {member.filename[:80]!r}")
    return data_at


def _member(
    reader: TorchFile, mapped: mmap.mmap | bytes, start: int, length: int, member: zipfile.ZipInfo
) -> memoryview:
    at = _member_offset(reader, mapped, start, length, member)
    return memoryview(mapped)[start + at : start + at + member.file_size]


def _read_legacy(reader: TorchFile, mapped: mmap.mmap | bytes, start: int, length: int) -> Any:
    """A legacy file: magic, protocol and system pickles, the object, the storage keys, then each storage's bytes."""
    view = memoryview(mapped)[start : start + length]
    small = PickleLimits(max_bytes=1 << 20, max_items=1 << 16)
    limits = PickleLimits(max_bytes=MAX_PICKLE_BYTES)
    at = 0
    magic, at = read_pickle(view, where=reader.where, globals_={}, limits=small, start=at)
    if magic != _LEGACY_MAGIC:
        raise InvalidInputError(f"{reader.where}: a pickle, not a file torch.save writes (no torch magic number)")
    protocol, at = read_pickle(view, where=reader.where, globals_={}, limits=small, start=at)
    info, at = read_pickle(view, where=reader.where, globals_={}, limits=small, start=at)
    if protocol != _LEGACY_PROTOCOL or not isinstance(info, dict) or info.get("little_endian") is not True:
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
    if not isinstance(keys, list) or sorted(keys) != sorted(reader.storages):
        raise InvalidInputError(f"{reader.where}: the legacy file's storage list does not match its tensors")
    for key in keys:
        storage = reader.storages[key]
        confined.check_region(reader.where, at, 8, length, f"storage {key[:40]!r}")
        (count,) = struct.unpack("<q", view[at : at + 8])
        if count != storage.numel:
            raise InvalidInputError(f"{reader.where}: storage {key[:40]!r} holds {count} elements, not {storage.numel}")
        confined.check_region(reader.where, at + 8, storage.nbytes, length, f"storage {key[:40]!r}")
        storage.flat = _flat(mapped, start + at + 8, storage)
        at += 8 + storage.nbytes
    return finish_value(value, where=reader.where)
