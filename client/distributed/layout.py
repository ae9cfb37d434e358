"""Where a ``torch.distributed.checkpoint`` item lives in a manifest, and back.

DCP flattens a nested state dict into items, each with an *object path*: dict keys as
strings, list indexes as ints, e.g. ``("optim", "state", "fc.weight", "exp_avg")`` or
``("optim", "param_groups", 0, "lr")``. Its item name (FQN) is the path joined by dots.

The manifest keeps the single-process layout, so a version saved by any number of ranks is
also an ordinary version (a plain ``client.load`` reads it):

- a tensor at path ``p`` gets the key ``join(*p)``: ``model/fc.weight``,
  ``optim/state/fc.weight/exp_avg``;
- every non-tensor value, and a ``{"__tensor__": key}`` reference for every tensor outside
  the model, sits at that path in the section's JSON tree (``state["optim"]`` is then exactly
  what a single-process save writes: ``state``, keyed by parameter name, and ``param_groups``);
- a top-level name that is not a section (``model``, ``optim``, ``scheduler``, ``extra``)
  moves under ``extra``; ``state["dcp"]["moved"]`` lists those names so load puts them back.

Reading derives every item from the manifest again, walking each tree the way DCP walks a
state dict (dicts always, lists unless they hold only plain values), so nothing about the
layout is stored twice and a version saved by one process reads through DCP as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptstore.client import keys
from ckptstore.client.jsonstate import MARKERS
from ckptstore.service.errors import InvalidNameError, StateEncodingError
from ckptstore.service.format.manifest import TENSOR_REF, Manifest, StateSection
from ckptstore.service.format.names import validate_run_id

SECTIONS = ("model", "optim", "scheduler", "extra")
TREE_SECTIONS: tuple[StateSection, ...] = ("optim", "scheduler", "extra")
#: The manifest's own state section describing a DCP save.
DCP_SECTION: StateSection = "dcp"

ObjPath = tuple[str | int, ...]


def names_a_run(checkpoint_id: object) -> bool:
    """Whether a DCP ``checkpoint_id`` is a valid run id (what the storage takes it as)."""
    try:
        validate_run_id(str(checkpoint_id))
    except InvalidNameError:
        return False
    return True


def fqn(path: ObjPath) -> str:
    """DCP's name of the item at ``path`` (``flatten_state_dict`` joins the parts by dots)."""
    return ".".join(map(str, path))


def _moves(path: ObjPath) -> bool:
    return not (len(path) > 1 and path[0] in SECTIONS)


def stored_path(path: ObjPath) -> ObjPath:
    """Where the item at DCP path ``path`` sits in the manifest (section first)."""
    return ("extra", *path) if _moves(path) else path


def tensor_key(path: ObjPath) -> str:
    """The manifest key of the tensor at DCP path ``path``."""
    return keys.join(*stored_path(path))


class StateTrees:
    """Builds the JSON trees of the sections from items given one at a time."""

    def __init__(self) -> None:
        self._root: dict[str | int, Any] = {}
        self.moved: set[str] = set()
        self._extra_names: set[str | int] = set()  # first-level names of the state's own 'extra'

    def put(self, path: ObjPath, encoded: Any) -> None:
        """Place one item's JSON (a value, or a tensor reference) at its path."""
        where = stored_path(path)
        if where[0] == "model":
            raise StateEncodingError(
                f"{fqn(path)}: the model's state holds a value that is not a tensor; "
                "checkpoints keep model tensors only (save other values under 'extra')"
            )
        if _moves(path):
            self.moved.add(str(path[0]))
        elif where[0] == "extra":
            self._extra_names.add(where[1])
        node = self._root
        for part, following in zip(where[:-1], where[1:], strict=True):
            child = node.setdefault(part, {})
            if isinstance(child, _Leaf) or (child and isinstance(following, int) != _int_keyed(child)):
                raise StateEncodingError(f"{fqn(path)}: clashes with another item stored at {keys.join(*where)}")
            node = child
        if where[-1] in node:
            raise StateEncodingError(f"{fqn(path)}: two items map to {keys.join(*where)}")
        node[where[-1]] = _Leaf(encoded)

    def sections(self) -> dict[str, Any]:
        """The finished trees by section, plus the ``dcp`` section saying which names moved."""
        clash = sorted(name for name in self.moved if name in self._extra_names)
        if clash:
            raise StateEncodingError(f"top-level state names {clash} are also keys under 'extra'; rename one of them")
        trees = {str(section): _finish(tree, str(section)) for section, tree in self._root.items()}
        trees[DCP_SECTION] = {"moved": sorted(self.moved)}
        return trees


def _int_keyed(node: dict[str | int, Any]) -> bool:
    return isinstance(next(iter(node)), int)


@dataclass(frozen=True)
class _Leaf:
    """An item's encoded JSON in a tree being built (a dict there is a container)."""

    encoded: Any


def _finish(node: Any, where: str) -> Any:
    """Turn int-keyed dicts into lists (DCP numbers list items 0, 1, …) and check structure."""
    if isinstance(node, _Leaf):
        return node.encoded
    if node and _int_keyed(node):
        if sorted(node) != list(range(len(node))):
            raise StateEncodingError(f"{where}: list items {sorted(node)} are not numbered 0..{len(node) - 1}")
        return [_finish(node[i], f"{where}/{i}") for i in range(len(node))]
    if len(node) == 1 and next(iter(node)) in MARKERS:
        raise StateEncodingError(f"{where}: a dict whose only key is {next(iter(node))!r} cannot be stored")
    return {key: _finish(value, f"{where}/{keys.escape(key)}") for key, value in node.items()}


@dataclass(frozen=True)
class StoredItem:
    """One DCP item found in a manifest: its path, and the tensor key or the encoded value."""

    path: ObjPath
    key: str | None = None
    value: Any = None


def stored_items(manifest: Manifest) -> Iterator[StoredItem]:
    """Every DCP item of a version, with its original path: model tensors, then each tree's leaves."""
    dcp: Any = manifest.state.get(DCP_SECTION)
    moved = set(dcp.get("moved", ())) if isinstance(dcp, dict) else set()
    for entry in manifest.tensors:
        if entry.key.startswith("model/"):
            yield StoredItem(tuple(keys.unescape(part) for part in entry.key.split("/")), key=entry.key)
    for section in TREE_SECTIONS:
        if section in manifest.state:
            for path, value in _leaves(manifest.state[section], (section,)):
                if section == "extra" and len(path) > 1 and path[1] in moved:
                    path = path[1:]
                if isinstance(value, dict) and len(value) == 1 and TENSOR_REF in value:
                    yield StoredItem(path, key=str(value[TENSOR_REF]))
                else:
                    yield StoredItem(path, value=value)


def _leaves(node: Any, path: ObjPath) -> Iterator[tuple[ObjPath, Any]]:
    """The leaves of a JSON tree as DCP's ``traverse_state_dict`` visits the value it encodes."""
    if isinstance(node, dict) and not _is_marker(node):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list) and not _is_terminal(node):
        for index, value in enumerate(node):
            yield from _leaves(value, (*path, index))
    else:
        yield path, node


def _is_marker(node: dict[str, Any]) -> bool:
    return len(node) == 1 and next(iter(node)) in MARKERS


def _is_terminal(values: list[Any]) -> bool:
    """DCP stores a list whole when it holds no dict, no tensor and no list that is not whole."""
    for value in values:
        if isinstance(value, dict) and (not _is_marker(value) or TENSOR_REF in value):
            return False
        if isinstance(value, list) and not _is_terminal(value):
            return False
    return True
