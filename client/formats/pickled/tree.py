"""A pickle's value measured as a tree and finished: one linear pass, never recursive.

Shared parts are visited once but counted wherever they appear, so a reference bomb
(``x = [x, x]`` forty times: a few hundred bytes that expand to 2**40 parts) is refused before
any code walks it, as are cycles and nesting past the limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckptstore.client.formats.pickled.allowlist import Built, PickleLimits, Record
from ckptstore.service.errors import InvalidInputError


def _children(node: Any) -> Iterator[Any] | None:
    """The values ``node`` holds, or None for a leaf."""
    if isinstance(node, (list, tuple, set, frozenset)):
        return iter(node)
    if isinstance(node, dict):
        return (x for pair in node.items() for x in pair)
    if isinstance(node, Record):
        return iter((node.args, node.state))
    return None


def finish_value(root: Any, *, where: str, limits: PickleLimits = PickleLimits()) -> Any:
    """``root`` measured as a tree and rebuilt with every :class:`Built` swapped for its result.

    One iterative post-order pass, shared parts visited once (so the pass is linear in what was
    read) but counted wherever they appear. Lists, dicts and sets are rebuilt, so a part the
    pickle shares stays shared; records keep their fields as read.

    Raises:
        InvalidInputError: a cycle, more than ``max_tree`` nodes, or deeper than ``max_depth``.
    """
    done: dict[int, tuple[Any, int, int]] = {}  # id -> (result, tree size, depth)
    keep: list[Any] = []  # what done's ids belong to, alive until the pass ends
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if key in done and not expanded:
            continue
        children = _children(node)
        if children is None:
            done[key] = (node.result() if isinstance(node, Built) else node, 1, 0)
            keep.append(node)
            continue
        if not expanded:
            on_path.add(key)
            stack.append((node, True))
            for child in children:
                if id(child) in on_path:
                    raise InvalidInputError(f"{where}: the pickle's value contains itself (a reference cycle)")
                if id(child) not in done:
                    stack.append((child, False))
            continue
        on_path.discard(key)
        parts = [done[id(child)] for child in _children(node) or ()]
        size = 1 + sum(part[1] for part in parts)
        depth = 1 + max((part[2] for part in parts), default=0)
        if size > limits.max_tree:
            raise InvalidInputError(
                f"{where}: the pickle's value expands to more than {limits.max_tree} parts when its shared "
                "references are followed, past the limit"
            )
        if depth > limits.max_depth:
            raise InvalidInputError(f"{where}: the pickle nests deeper than the limit of {limits.max_depth} levels")
        try:
            rebuilt = _rebuilt(node, [part[0] for part in parts])
        except TypeError:  # a key the reader let through (hashed by identity) finished as an unhashable value
            raise InvalidInputError(
                f"{where}: a dict key or set member of the pickle is not hashable once it is made"
            ) from None
        done[key] = (rebuilt, size, depth)
        keep.append(node)
    return done[id(root)][0]


def _rebuilt(node: Any, values: list[Any]) -> Any:
    """A container like ``node`` holding ``values`` (its children's results, in order)."""
    if isinstance(node, list):
        return values
    if isinstance(node, tuple):
        return tuple(values)
    if isinstance(node, (set, frozenset)):
        return type(node)(values)
    if isinstance(node, dict):
        return dict(zip(values[0::2], values[1::2], strict=True))
    record: Record = node
    record.args, record.state = values[0], values[1]
    return record.result()
