"""DCP checkpoint folders (``.metadata`` + ``*.distcp``), read by this code from the metadata's offsets.

The ``.metadata`` pickle is read by :mod:`client.formats.pickled.reader` with DCP's metadata
classes as plain :class:`Record` s (never the classes themselves). Everything it claims is
checked before a byte of data is read:

- each tensor's chunks lie inside it and cover it exactly once (no gap, no overlap), so every
  stored byte comes from the source and none is left as whatever memory held
  (:func:`~client.formats.dcp.cover.check_cover`);
- each item's ``relative_path`` names a regular file inside the folder, and its offset and
  length lie inside that file;
- no two items (tensor chunks or byte entries) read overlapping bytes, so each stored item is
  read once (:func:`~client.formats.dcp.cover.check_regions`);
- each name is a string of at most :data:`MAX_NAME_CHARS` characters, and each nested key path
  (``planner_data``) is a short tuple of names and indices.

No value of the metadata is formatted, hashed or compared before it is known to be one of these
bounded fields: messages describe any other value by its type.

Then each item's bytes, a ``torch.save`` archive, are read by :mod:`client.formats.torch_save.files`:
a chunk must hold a tensor of exactly the chunk's shape and the tensor's dtype; a byte item
(any other value DCP pickled) is read under the same allow-list as any ``.pt`` file. Each tensor
put together from its chunks is charged to the import's budget (:mod:`client.formats.budget`)
before it is made.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ckptstore.client.formats import budget, confined
from ckptstore.client.formats.dcp.cover import check_cover, check_regions
from ckptstore.client.formats.pickled.allowlist import Global, GlobalTable, PickleLimits, Record
from ckptstore.client.formats.pickled.reader import read_pickle
from ckptstore.client.formats.torch_save.constructors import RefusedTensor
from ckptstore.client.formats.torch_save.files import read_torch_bytes
from ckptstore.service.errors import InvalidInputError

METADATA = ".metadata"
#: The largest ``.metadata`` read (it lists every chunk of every tensor).
MAX_METADATA_BYTES = 256 << 20
#: Most chunks of one tensor, and most entries of a checkpoint.
MAX_CHUNKS = 1 << 16
MAX_ENTRIES = 1 << 20
#: Longest nested key path and largest list index a path may hold.
MAX_PATH_DEPTH = 64
MAX_LIST_INDEX = 1 << 20
#: Longest name (an entry's fqn, a key of its path, a data file's relative path).
MAX_NAME_CHARS = 4096
#: Longest layout name (``torch.strided``).
MAX_LAYOUT_CHARS = 64

_DCP = "torch.distributed.checkpoint.metadata"
_RECORDS = (
    {
        (_DCP, name): name
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "_StorageInfo"}
    | {("pathlib", name): "path" for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")}
)


def _record(kind: str) -> Global:
    """DCP's class ``kind`` as a :class:`Record` maker, whether the pickle calls or instantiates it."""

    def make(args: tuple[Any, ...]) -> Record:
        return Record(kind, args)

    return Global(kind, call=make, new=make)


def _kind(value: Any) -> str:
    """``value`` described by its type alone (a record by its class), never by its contents."""
    if isinstance(value, Record):
        return "a pathlib path" if value.kind == "path" else f"DCP's {value.kind}"
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _metadata_globals(where: str) -> GlobalTable:
    """The callables a ``.metadata`` may name. Each runs while the pickle is still being read, before
    its values are bounded, so each looks at the types and lengths of its arguments only."""

    def layout(args: tuple[Any, ...]) -> str:
        if len(args) != 1 or not isinstance(args[0], str) or len(args[0]) > MAX_LAYOUT_CHARS:
            shown = _kind(args[0]) if len(args) == 1 else f"{len(args)} values"
            raise InvalidInputError(f"{where}: a tensor's layout is given as {shown}, not a layout name")
        return args[0]

    def size(args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args:
            return ()
        if len(args) != 1 or not isinstance(args[0], (list, tuple)) or len(args[0]) > 64:
            shown = _kind(args[0]) if len(args) == 1 else f"{len(args)} values"
            raise InvalidInputError(f"{where}: a torch.Size is made of {shown}, not a list of at most 64 sizes")
        return tuple(args[0])

    table: dict[tuple[str, str], Any] = {key: _record(kind) for key, kind in _RECORDS.items()}
    table[("torch.serialization", "_get_layout")] = Global("layout", call=layout)
    table[("torch", "Size")] = Global("torch.Size", call=size)
    table[("collections", "OrderedDict")] = Global("OrderedDict", call=lambda args: {})
    table.update({("torch", n): d for n in dir(torch) if isinstance(d := getattr(torch, n, None), torch.dtype)})
    return table


def read_metadata(path: Path) -> Record:
    """The ``Metadata`` record of a ``.metadata`` file (fields as read; see :func:`read_dcp_folder`)."""
    data = confined.read_small(path, MAX_METADATA_BYTES)
    value, _ = read_pickle(
        data, where=str(path), globals_=_metadata_globals(str(path)), limits=PickleLimits(max_bytes=MAX_METADATA_BYTES)
    )
    if not isinstance(value, Record) or value.kind != "Metadata":
        raise InvalidInputError(f"{path}: holds a {type(value).__name__}, not DCP metadata")
    return value


def _field(record: Any, kind: str, name: str, index: int | None, where: str) -> Any:
    if not isinstance(record, Record) or record.kind != kind:
        raise InvalidInputError(
            f"{where}: not a DCP metadata record: expected DCP's {kind}, found a {type(record).__name__}"
        )
    try:
        return record.field(name, index)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{where}: {exc}") from None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 64 or not all(type(v) is int and v >= 0 for v in value):
        raise InvalidInputError(f"{what} is not a list of at most 64 non-negative integers")
    return tuple(value)


def _name(value: Any, what: str) -> str:
    """``value`` once it is a string of at most :data:`MAX_NAME_CHARS` characters."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} is {_kind(value)}, not a string")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidInputError(f"{what} is {len(value)} characters long, past the limit of {MAX_NAME_CHARS}")
    return value


class _Item(NamedTuple):
    """One region the checkpoint reads: a tensor's chunk (at ``chunk``) or a byte entry (``chunk`` None)."""

    fqn: str
    chunk: tuple[int, ...] | None
    path: Path
    mapped: mmap.mmap | bytes
    offset: int
    length: int

    def describe(self) -> str:
        """The item, in a message."""
        if self.chunk is None:
            return f"item {self.fqn[:80]!r}"
        return f"chunk {list(self.chunk)} of tensor {self.fqn[:80]!r}"


class _Folder:
    """The folder's files, each name resolved, checked and mapped once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, tuple[Path, mmap.mmap | bytes]] = {}

    def item(self, fqn: str, chunk: tuple[int, ...] | None, info: Any, where: str) -> _Item:
        """The file, its mapping and ``(offset, length)`` a ``_StorageInfo`` names, all checked."""
        what = f"{where} ({'item' if chunk is None else 'tensor'} {fqn[:80]!r})"
        name = _field(info, "_StorageInfo", "relative_path", 0, what)
        if not isinstance(name, str):
            raise InvalidInputError(
                f"{what}: its file is named by {_kind(name)}, not a plain file name; a source names only its own "
                f"files, never a place outside {self.root}"
            )
        _name(name, f"{what}: its file name")
        if isinstance(info.state, dict) and info.state.get("transform_descriptors"):
            raise InvalidInputError(
                f"{what}: the item is stored transformed (compressed), which ckptstore does not read"
            )
        if name not in self.files:
            path = confined.inside(self.root, name, named_in=what)
            self.files[name] = path, confined.map_file(path) or b""
        path, mapped = self.files[name]
        offset, length = confined.check_region(
            path,
            _field(info, "_StorageInfo", "offset", 1, what),
            _field(info, "_StorageInfo", "length", 2, what),
            len(mapped),
            what,
        )
        return _Item(fqn, chunk, path, mapped, offset, length)


def _storage_index(metadata: Record, where: str) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    storage_data = metadata.field("storage_data", None) if isinstance(metadata.state, dict) else None
    if not isinstance(storage_data, dict) or len(storage_data) > MAX_ENTRIES:
        raise InvalidInputError(f"{where}: storage_data is not a dict of at most {MAX_ENTRIES} entries")
    index: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for key, info in storage_data.items():
        fqn = _name(_field(key, "MetadataIndex", "fqn", 0, where), f"{where}: an item's name")
        offset = key.state.get("offset") if isinstance(key.state, dict) else None
        index[(fqn, None if offset is None else _ints(offset, f"{where}: {fqn[:80]!r}'s offset"))] = info
    return index


def read_dcp_folder(directory: Path) -> dict[str, Any]:
    """Every item of the DCP checkpoint in ``directory``, as the nested state_dict it was saved from, on the CPU.

    Raises:
        InvalidInputError: a file, path, region, chunk layout or value the checks above refuse.
    """
    meta_path = directory / METADATA
    metadata = read_metadata(meta_path)
    where = str(meta_path)
    entries = _field(metadata, "Metadata", "state_dict_metadata", 0, where)
    if not isinstance(entries, dict) or len(entries) > MAX_ENTRIES:
        raise InvalidInputError(f"{where}: state_dict_metadata is not a dict of at most {MAX_ENTRIES} entries")
    storage = _storage_index(metadata, where)
    planner = metadata.state.get("planner_data") if isinstance(metadata.state, dict) else None
    plans = {fqn: _plan_tensor(fqn, entry, where) for fqn, entry in entries.items()}  # every claim, before any read
    folder = _Folder(directory)
    items = {fqn: _items(fqn, plan, storage, folder, where) for fqn, plan in plans.items()}
    every = [item for found in items.values() for item in found]
    check_regions([(str(i.path), i.offset, i.length, n) for n, i in enumerate(every)], _describer(every), where)
    flat: dict[str, Any] = {}
    for fqn, plan in plans.items():
        if plan is None:
            (item,) = items[fqn]
            flat[fqn] = read_torch_bytes(
                item.mapped, item.offset, item.length, where=f"{item.path} (item {fqn[:80]!r})"
            )
        else:
            flat[fqn] = _read_tensor(fqn, plan, items[fqn], where)
    return _nested(flat, planner, where)


def _describer(items: list[_Item]) -> Callable[[int], str]:
    return lambda n: items[n].describe()


def _items(
    fqn: str,
    plan: tuple[torch.dtype, tuple[int, ...], list[Any]] | None,
    storage: dict[Any, Any],
    folder: _Folder,
    where: str,
) -> list[_Item]:
    """The regions ``fqn`` reads: its one item, or each of its chunks, in the order of its chunks."""
    if plan is None:
        info = storage.get((fqn, None))
        if info is None:
            raise InvalidInputError(f"{where}: item {fqn[:80]!r} has no bytes recorded")
        return [folder.item(fqn, None, info, where)]
    found = []
    for offsets, _ in plan[2]:
        info = storage.get((fqn, offsets))
        if info is None:
            raise InvalidInputError(f"{where}: chunk {list(offsets)} of tensor {fqn[:80]!r} has no bytes recorded")
        found.append(folder.item(fqn, offsets, info, where))
    return found


def _plan_tensor(fqn: Any, entry: Any, where: str) -> tuple[torch.dtype, tuple[int, ...], list[Any]] | None:
    """A tensor's dtype, size and chunks, checked to cover it exactly; None for a byte item."""
    _name(fqn, f"{where}: an entry's name")
    if isinstance(entry, Record) and entry.kind == "BytesStorageMetadata":
        return None
    what = f"{where}: tensor {fqn[:80]!r}"
    properties = _field(entry, "TensorStorageMetadata", "properties", 0, what)
    dtype = _field(properties, "TensorProperties", "dtype", 0, what)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInputError(f"{what}: its dtype is not a torch dtype")
    size = _ints(_field(entry, "TensorStorageMetadata", "size", 1, what), f"{what}: its size")
    chunks = _field(entry, "TensorStorageMetadata", "chunks", 2, what)
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
        raise InvalidInputError(f"{what}: its chunks are not a list of at most {MAX_CHUNKS}")
    boxes = [
        (
            _ints(_field(c, "ChunkStorageMetadata", "offsets", 0, what), f"{what}: a chunk's offsets"),
            _ints(_field(c, "ChunkStorageMetadata", "sizes", 1, what), f"{what}: a chunk's sizes"),
        )
        for c in chunks
    ]
    check_cover(size, boxes, what)
    return dtype, size, boxes


def _read_tensor(fqn: str, plan: tuple[torch.dtype, tuple[int, ...], list[Any]], items: list[_Item], where: str) -> Any:
    dtype, size, boxes = plan
    whole = len(boxes) != 1 or boxes[0][1] != size  # put together from its chunks, not one chunk as it is
    if whole:
        budget.charge(math.prod(size) * dtype.itemsize, f"{where}: tensor {fqn[:80]!r}")
    pieces = []
    for (offsets, sizes), item in zip(boxes, items, strict=True):
        path = item.path
        piece = read_torch_bytes(item.mapped, item.offset, item.length, where=f"{path} (tensor {fqn[:80]!r})")
        if isinstance(piece, RefusedTensor):
            raise InvalidInputError(f"{path}: tensor {fqn[:80]!r} {piece.reason}")
        if not isinstance(piece, torch.Tensor) or piece.dtype != dtype or tuple(piece.shape) != sizes:
            shown = f"a {piece.dtype} tensor of {list(piece.shape)}" if isinstance(piece, torch.Tensor) else "no tensor"
            raise InvalidInputError(
                f"{path}: chunk {list(offsets)} of tensor {fqn[:80]!r} holds {shown} ({_nbytes(piece)} bytes), where "
                f"{where} claims a {dtype} chunk of {list(sizes)} ({math.prod(sizes) * dtype.itemsize} bytes)"
            )
        pieces.append((offsets, piece))
    if not whole:
        return pieces[0][1]
    made = torch.empty(size, dtype=dtype)
    for offsets, piece in pieces:
        target = made
        for dim, (start, length) in enumerate(zip(offsets, piece.shape, strict=True)):
            target = target.narrow(dim, start, length)
        target.copy_(piece)
    return made


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _nested(flat: dict[str, Any], planner: Any, where: str) -> dict[str, Any]:
    """``flat`` (by DCP's flattened name) placed at each name's key path, as DCP's own loader does."""
    if planner is None:
        return flat
    if not isinstance(planner, dict):
        raise InvalidInputError(f"{where}: planner_data is not a dict")
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = planner.get(fqn, (fqn,))
        if not isinstance(path, (tuple, list)) or not path:
            raise InvalidInputError(f"{where}: the key path of {fqn[:80]!r} is not a list of keys")
        if len(path) > MAX_PATH_DEPTH:
            raise InvalidInputError(
                f"{where}: the key path of {fqn[:80]!r} is {len(path)} deep, past the limit of {MAX_PATH_DEPTH}"
            )
        _place(root, list(path), value, f"{where}: the key path of {fqn[:80]!r}")
    return root


def _place(root: dict[str, Any], path: list[Any], value: Any, what: str) -> None:
    for key in path:
        if isinstance(key, str):
            _name(key, f"{what}: a key")
        elif type(key) is not int or not 0 <= key < MAX_LIST_INDEX:
            shown = f"the index {key}" if type(key) is int else _kind(key)
            raise InvalidInputError(f"{what} holds {shown}, neither a name nor a list index below the limit")
    if not isinstance(path[0], str):
        raise InvalidInputError(f"{what} starts with an index, not a name")
    container: Any = root
    for key, following in zip(path, path[1:], strict=False):
        fresh: Any = {} if isinstance(following, str) else []
        container = _child(container, key, fresh, what)
    _set(container, path[-1], value, what)


def _child(container: Any, key: Any, fresh: Any, what: str) -> Any:
    if isinstance(container, dict) and isinstance(key, str):
        existing = container.setdefault(key, fresh)
    elif isinstance(container, list) and isinstance(key, int):
        container.extend([None] * (key + 1 - len(container)))
        if container[key] is None:
            container[key] = fresh
        existing = container[key]
    else:
        raise InvalidInputError(f"{what} indexes a {type(container).__name__} with {str(key)[:40]!r}")
    if type(existing) is not type(fresh):
        raise InvalidInputError(f"{what} conflicts with another item's path")
    return existing


def _set(container: Any, key: Any, value: Any, what: str) -> None:
    if isinstance(container, dict) and isinstance(key, str):
        container[key] = value
    elif isinstance(container, list) and isinstance(key, int):
        container.extend([None] * (key + 1 - len(container)))
        container[key] = value
    else:
        raise InvalidInputError(f"{what} indexes a {type(container).__name__} with {str(key)[:40]!r}")
