"""What the pickle reader is handed and hands back: its limits, allowed callables, builders and records."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from service.errors import InvalidInputError


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


@dataclass(frozen=True)
class Global:
    """A callable a pickle may name: ``call`` for ``REDUCE``, ``new`` for ``NEWOBJ``.

    Both receive the pickle's argument tuple and return a value (or a :class:`Built`);
    neither is the object the pickle names, only the caller's stand-in for it.
    """

    name: str
    call: Callable[[tuple[Any, ...]], Any] | None = None
    new: Callable[[tuple[Any, ...]], Any] | None = None


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
        return f"{self.kind}{self.args!r}"


GlobalTable = Mapping[tuple[str, str], Any]
