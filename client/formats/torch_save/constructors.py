"""What a ``torch.save`` pickle may name, as the pickle reader's table, and the checks on each.

Tensors (``_rebuild_tensor_v2`` / ``_rebuild_parameter`` over a storage of the file, and
``_rebuild_tensor_v3``, how torch writes the dtypes it has no typed storage for (uint16-64,
float8), over an untyped storage read as its dtype; checked in bounds, non-negative strides and
no more bytes than the storage holds: an expanded or overlapping view becomes a
:class:`RefusedTensor` the importer reports under its key, unless ``expand_limit`` lets it
through), ``OrderedDict`` (its ``_metadata`` dropped), ``torch.Size``,
dtypes and storage types, sets, ``bytes()``, ``_codecs.encode`` to latin1 bytes, and, for RNG
state only, numpy arrays and scalars of plain numeric dtypes rebuilt from their raw bytes.

What a file makes from its own bytes is bounded: each tensor is charged its bytes against the
import's budget (:func:`client.formats.budget.charge`) before it is made, a view as much as a
copy, and an untyped storage whose bytes are misaligned for a dtype is copied once, whatever the
number of tensors over it. The pickle's values are checked by type before they are compared,
and named in messages by :func:`~client.formats.pickled.allowlist.shown` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstore.client.formats import budget
from ckptstore.client.formats.pickled.allowlist import Built, Global, GlobalTable, shown
from ckptstore.service.errors import InvalidInputError

#: Most storages one file may hold.
MAX_STORAGES = 1 << 20
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
_DTYPE_SET = frozenset(_DTYPES.values())
#: Alignment of a tensor torch allocates (its CPU allocator's), enough for every dtype.
_ALIGNMENT = 64
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
    #: ``flat`` copied to an aligned address, made the first time a tensor needs it.
    aligned: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds."""
        return self.numel * itemsize(self.dtype)

    def aligned_for(self, size: int) -> torch.Tensor:
        """``flat`` at an address that is a multiple of ``size``: itself where it is, else one copy,
        made once and shared by every tensor over the storage."""
        if self.flat is None:
            raise InvalidInputError(f"storage {shown(self.key)} has no bytes in the file")
        if self.flat.data_ptr() % size == 0:
            return self.flat
        if self.aligned is None:
            self.aligned = self.flat.clone()
            if self.aligned.data_ptr() % _ALIGNMENT:  # never for torch's allocator; checked, not assumed
                raise InvalidInputError(f"storage {shown(self.key)}: a copy of its bytes is not aligned")
        return self.aligned


@dataclass(frozen=True)
class RefusedTensor:
    """A tensor that could not be made over its bytes; ``reason`` says why (the key is the caller's)."""

    reason: str


class _TensorRecord(Built):
    """``_rebuild_tensor_v2``'s arguments, checked; made into a view at the end of the read."""

    def __init__(
        self,
        storage: Storage,
        offset: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        expand_limit: int,
        dtype: torch.dtype | None = None,
        where: str = "",
    ):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.expand_limit, self.where = expand_limit, where
        #: The dtype an untyped (byte) storage is read as (``_rebuild_tensor_v3``); None: the storage's own.
        self.dtype = dtype
        #: ``requires_grad`` of the ``torch.nn.Parameter`` the pickle makes of this tensor; None: a plain tensor.
        self.parameter: bool | None = None

    def result(self) -> Any:
        numel = 1
        for dim in self.size:
            numel *= dim
        dtype = self.dtype or self.storage.dtype
        size = itemsize(dtype)
        elements = self.storage.nbytes // size
        extent = self.offset + sum((d - 1) * s for d, s in zip(self.size, self.stride, strict=True)) + 1
        if numel and extent > elements:
            return RefusedTensor(
                f"reaches element {extent} of a storage of {elements} elements: it lies past its bytes"
            )
        claimed = numel * size
        if claimed > self.storage.nbytes and claimed > self.expand_limit:
            return RefusedTensor(
                f"claims {claimed} bytes ({list(self.size)} x {size}) over a storage of "
                f"{self.storage.nbytes} bytes "
                "(an expanded view that repeats its bytes); save it with .contiguous(), or allow expanded tensors "
                "up to a size with --allow-expanded"
            )
        if self.storage.flat is None:
            raise InvalidInputError(f"{self.where}: storage {shown(self.storage.key)} has no bytes in the file")
        # Charged before anything is made: a view is stored as a copy is. An expanded tensor (let
        # through by expand_limit) is stored, and charged, as the bytes of its storage.
        expanded = numel > 1 and 0 in self.stride
        budget.charge(self.storage.nbytes if expanded else claimed, self.where or "a tensor")
        flat = self.storage.flat
        if dtype != flat.dtype:  # an untyped storage: its whole elements, read as the tensor's dtype
            flat = self.storage.aligned_for(size)[: elements * size].view(dtype)
        tensor = torch.as_strided(flat, self.size, self.stride, self.offset)
        if self.parameter is None:
            return tensor
        if self.parameter and not (dtype.is_floating_point or dtype.is_complex):
            return RefusedTensor(f"is a parameter of {dtype} that requires grad, which only floating tensors can")
        return torch.nn.Parameter(tensor, requires_grad=self.parameter)  # a view still: no byte is copied


class _NumpyArray(Built):
    """``numpy.core.multiarray._reconstruct(ndarray, ...)`` finished by ``BUILD``: a numeric array."""

    def __init__(self, where: str) -> None:
        self.value: Any = None
        self.where = where

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
        budget.charge(len(raw), self.where)  # one pickled bytes object may be the state of many arrays
        self.value = numpy.frombuffer(raw, dtype=kind).reshape(shape, order="F" if fortran else "C").copy()

    def result(self) -> Any:
        if self.value is None:
            raise InvalidInputError("a numpy array is never given its bytes")
        return self.value


class _NumpyDtype(Built):
    """``numpy.dtype(kind, align, copy)``; ``BUILD`` gives its byte order."""

    def __init__(self, kind: Any) -> None:
        if not isinstance(kind, str) or kind.lstrip("<>|=") not in _NUMPY_KINDS:
            raise InvalidInputError(f"numpy dtype {shown(kind)} is not a plain numeric type")
        self.kind, self.order = kind, "<"

    def build(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) > 1 and type(state[1]) is str and state[1] in ("<", ">", "|", "="):
            self.order = state[1]
        else:
            raise InvalidInputError("a numpy dtype's state is not one numpy writes")

    def numpy(self) -> Any:
        import numpy

        return numpy.dtype(self.order.replace("|", "=") + self.kind.lstrip("<>|="))


def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
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
        if not isinstance(pid, tuple) or len(pid) not in (5, 6) or type(pid[0]) is not str or pid[0] != "storage":
            raise InvalidInputError(f"{self.where}: a persistent id that is not a storage of this file")
        storage_type, key, _, numel = pid[1:5]
        if not isinstance(key, str):
            raise InvalidInputError(f"{self.where}: a storage's key is {shown(key)}, not a string")
        if not isinstance(storage_type, StorageType) or type(numel) is not int or numel < 0:
            raise InvalidInputError(f"{self.where}: storage {shown(key)} is described with the wrong types")
        if len(pid) == 6 and pid[5] is not None:
            raise InvalidInputError(
                f"{self.where}: storage {shown(key)} is a view of another storage, which is not read"
            )
        known = self.storages.get(key)
        if known is not None:
            if known.dtype != storage_type.dtype or known.numel != numel:
                raise InvalidInputError(f"{self.where}: storage {shown(key)} is described twice, differently")
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
        if hooks is not None and not (type(hooks) is dict and not hooks):
            raise InvalidInputError(f"{self.where}: a tensor with backward hooks, which ckptstore never runs")
        return _TensorRecord(storage, offset, size, stride, self.expand_limit, where=self.where)

    def rebuild_tensor_v3(self, args: tuple[Any, ...]) -> _TensorRecord:
        """``_rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[, metadata])``:
        a tensor of ``dtype`` over an untyped storage, checked as :meth:`rebuild_tensor` checks one."""
        dtype = _check_args(args, 7, "a tensor")[6]
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPE_SET:
            named = str(dtype) if isinstance(dtype, torch.dtype) else shown(dtype)
            raise InvalidInputError(f"{self.where}: a tensor of dtype {named}, not one ckptstore reads")
        record = self.rebuild_tensor(args[:6])
        if record.storage.dtype != torch.uint8:
            raise InvalidInputError(f"{self.where}: a tensor of dtype {dtype} over a typed storage, not an untyped one")
        record.dtype = dtype
        return record

    def globals_table(self) -> GlobalTable:
        """What this file's pickles may name."""
        table: dict[tuple[str, str], Any] = {
            ("collections", "OrderedDict"): Global("OrderedDict", call=_ordered_dict),
            ("torch._utils", "_rebuild_tensor_v2"): Global("tensor", call=self.rebuild_tensor),
            ("torch._utils", "_rebuild_tensor"): Global("tensor", call=self.rebuild_tensor),
            ("torch._utils", "_rebuild_tensor_v3"): Global("tensor", call=self.rebuild_tensor_v3),
            ("torch.storage", "UntypedStorage"): StorageType(torch.uint8),
            ("torch._utils", "_rebuild_parameter"): Global("parameter", call=_parameter),
            ("torch", "Size"): Global(
                "torch.Size", call=lambda args: _dims(_check_args(args, 1, "torch.Size")[0], "a torch.Size")
            ),
            ("_codecs", "encode"): Global("bytes", call=lambda args: _codecs_encode(args, self.where)),
        }
        table.update({("torch", name): dtype for name, dtype in _DTYPES.items()})
        table.update({("torch", name): StorageType(dtype) for name, dtype in _STORAGE_TYPES.items()})
        for module in ("builtins", "__builtin__"):
            table[(module, "set")] = Global("set", call=lambda args: set(_members(args)), hashes=True)
            table[(module, "frozenset")] = Global("frozenset", call=lambda args: frozenset(_members(args)), hashes=True)
            table[(module, "bytes")] = Global("bytes", call=_empty_bytes)
        if self.numpy_arrays:
            for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
                table[(module, "_reconstruct")] = Global("numpy array", call=lambda args: _NumpyArray(self.where))
                table[(module, "scalar")] = Global("numpy scalar", call=_numpy_scalar)
            table[("numpy", "ndarray")] = Global("numpy.ndarray")
            table[("numpy", "dtype")] = Global(
                "numpy.dtype", call=lambda args: _NumpyDtype(_check_args(args, 1, "dtype")[0])
            )
        return table


def _ordered_dict(args: tuple[Any, ...]) -> dict[Any, Any]:
    if len(args) > 1 or (args and not (type(args[0]) is list and not args[0])):
        raise InvalidInputError("an OrderedDict is made with arguments")
    return {}


def _members(args: tuple[Any, ...]) -> list[Any] | tuple[Any, ...]:
    """A set's members: a list or tuple the reader has checked (the set global ``hashes`` them)."""
    members = _check_args(args, 1, "set")[0]
    if type(members) not in (list, tuple):
        raise InvalidInputError(f"a set is made from {shown(members)}, not a list of its members")
    return members


def _parameter(args: tuple[Any, ...]) -> Any:
    """``_rebuild_parameter(data, requires_grad, hooks)``: the tensor, to be made a Parameter with its flag."""
    data, requires_grad = _check_args(args, 2, "a parameter")[:2]
    if not isinstance(data, _TensorRecord) or data.parameter is not None or type(requires_grad) is not bool:
        raise InvalidInputError("a parameter that holds no tensor of its own, or no requires_grad flag")
    data.parameter = requires_grad
    return data


def _empty_bytes(args: tuple[Any, ...]) -> bytes:
    """``bytes()``: how protocols 0-2 write an empty bytes object."""
    if args:
        raise InvalidInputError("bytes is made with arguments")
    return b""


def _codecs_encode(args: tuple[Any, ...], where: str) -> bytes:
    """``_codecs.encode(text, "latin1")``, how protocol 2 writes bytes; charged, as one pickled string
    may be encoded many times."""
    text, encoding = _check_args(args, 2, "_codecs.encode")[:2]
    if not isinstance(text, str) or type(encoding) is not str or encoding != "latin1":
        raise InvalidInputError("_codecs.encode is asked for something other than latin1 bytes")
    budget.charge(len(text), where)
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
