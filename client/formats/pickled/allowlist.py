"""What the pickle reader is handed and hands back: its limits, allowed callables, builders and records.

A value read from a pickle is not known to be bounded until the reader has measured it, and even
then a message has no use for all of it: :func:`shown` describes one in a few dozen characters
(an atom, cut short, or a type name), never by ``str()``/``repr()`` of a container.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptstore.service.errors import InvalidInputError


@dataclass(frozen=True)
class PickleLimits:
    """What one pickle may hold; anything past a limit is refused while it is read."""

    #: The pickle's own bytes.
    max_bytes: int = 1 << 30
    #: Objects made plus references taken (each list item, dict entry, memo fetch counts one).
    max_items: int = 1 << 24
    #: Memo entries.
    max_memo: int = 1 << 22
    #: Nodes of the value as a tree, shared parts counted wherever they appear.
    max_tree: int = 1 << 23
    #: Nesting of containers.
    max_depth: int = 100
    #: Bytes of one integer.
    max_int_bytes: int = 32
    #: Parts of one dict key or set member that is a tuple (or frozenset), itself included.
    max_key_parts: int = 32
    #: Nesting of one such key.
    max_key_depth: int = 8
    #: Dict keys and set members whose hash an attacker can choose to collide (tuples, frozensets and
    #: integers of 61 bits or more), in the whole pickle: each costs a comparison with every other of
    #: its hash, so their number is bounded, not only their size.
    max_composite_keys: int = 4096


@dataclass(frozen=True)
class Global:
    """A callable a pickle may name: ``call`` for ``REDUCE``, ``new`` for ``NEWOBJ``.

    Both receive the pickle's argument tuple and return a value (or a :class:`Built`);
    neither is the object the pickle names, only the caller's stand-in for it.
    """

    name: str
    call: Callable[[tuple[Any, ...]], Any] | None = None
    new: Callable[[tuple[Any, ...]], Any] | None = None
    #: The call hashes the items of its first argument (a list or tuple: a set's members): the
    #: reader checks them as it checks dict keys before calling it.
    hashes: bool = False


class Built:
    """A value a pickle finishes with ``BUILD``; the reader swaps it for :meth:`result` at the end."""

    def build(self, state: Any) -> None:
        """Take the ``BUILD`` state (once)."""
        raise InvalidInputError(f"{type(self).__name__} takes no state")

    def result(self) -> Any:
        """The finished value."""
        return self


class Record(Built):
    """An instance of an allowed class as plain data: its name, its arguments and its state.

    Never the class itself: the reader of a format (DCP's metadata) reads the fields it needs.
    """

    __slots__ = ("kind", "args", "state")

    def __init__(self, kind: str, args: tuple[Any, ...]) -> None:
        self.kind = kind
        self.args = args
        self.state: Any = None

    def build(self, state: Any) -> None:
        """Keep the state, which may be given once."""
        if self.state is not None:
            raise InvalidInputError(f"{self.kind} is given its state twice")
        self.state = state

    def field(self, name: str, index: int | None = None) -> Any:
        """A field of the state: ``state[name]`` for a dict state, ``state[index]`` for a tuple."""
        if isinstance(self.state, dict) and name in self.state:
            return self.state[name]
        if isinstance(self.state, tuple) and index is not None and index < len(self.state):
            return self.state[index]
        raise InvalidInputError(f"{self.kind} has no {name}")

    def __repr__(self) -> str:
        return f"{self.kind}({', '.join(shown(arg) for arg in self.args[:8])}{', …' if len(self.args) > 8 else ''})"


GlobalTable = Mapping[tuple[str, str], Any]

_ATOMS = (bool, int, float, type(None))


def shown(value: Any, limit: int = 40) -> str:
    """``value`` for a message, in O(``limit``): a string or bytes cut to ``limit`` characters and quoted,
    a number or None as written (an integer past ``limit`` digits by its size), anything else by its
    type's name alone (a container's contents are never formatted: they may be a reference bomb)."""
    if type(value) is str or type(value) is bytes:
        return repr(value[:limit]) + ("…" if len(value) > limit else "")
    if type(value) is int and value.bit_length() > 3 * limit:
        return f"an integer of {value.bit_length()} bits"
    if type(value) in _ATOMS:
        return repr(value)[: limit * 2]
    return f"a {type(value).__name__}"
