"""JSON files of a checkpoint folder (configs, indexes, headers, trainer state), parsed strictly.

What a parse may build is bounded by the text's structural bytes, counted before it is parsed
(:func:`check_structure`): each object needs a ``{``, each array a ``[``, and every value past
the first of a container a ``,``. None of those can be spelled another way outside a string
(``\\u007b`` is a brace only inside one), so counting every such byte, strings included, bounds
the parsed structure however its keys are spelled; it over-counts only what strings hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.jsondoc import strict_decoder


@dataclass(frozen=True)
class Structure:
    """The most objects, arrays and values a JSON text may hold once parsed (strings' bytes included)."""

    objects: int
    arrays: int
    values: int

    @classmethod
    def of(cls, text: bytes) -> Structure:
        objects, arrays = text.count(b"{"), text.count(b"[")
        return cls(objects, arrays, objects + arrays + text.count(b",") + 1)


def check_structure(text: bytes, what: str, *, objects: int, arrays: int, values: int, unit: str = "") -> None:
    """Refuse ``text`` before it is parsed when it could hold more than ``objects`` objects, ``arrays``
    arrays or ``values`` values (``unit``: what one object is, for the message: ``" (one per tensor)"``).

    Raises:
        InvalidInputError: ``what``, the count and the limit.
    """
    found = Structure.of(text)
    for count, limit, noun in (
        (found.objects, objects, f"objects{unit}"),
        (found.arrays, arrays, "arrays"),
        (found.values, values, "values"),
    ):
        if count > limit:
            raise InvalidInputError(f"{what} holds up to {count} JSON {noun}, past the limit of {limit}")


def parse_json(text: bytes, what: str, *, floats: bool, constants: bool = False) -> Any:
    """The JSON value of ``text``: UTF-8, no duplicate keys; ``floats=False`` refuses non-integers,
    ``constants=True`` lets NaN and Infinity through (a trainer's logged losses may be NaN).

    Raises:
        InvalidInputError: ``what`` and what is wrong, never a traceback (deep nesting included).
    """
    decoder = strict_decoder(InvalidInputError, what, floats=floats)
    if constants:  # the same check of duplicate keys, NaN and Infinity let through
        decoder = json.JSONDecoder(object_pairs_hook=decoder.object_pairs_hook)
    try:
        return decoder.decode(text.decode("utf-8"))
    except InvalidInputError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{what} is not valid JSON: {str(exc)[:200]}") from exc


def large_integers(value: Any, limit: int, where: str = "") -> tuple[str, int] | None:
    """The first integer above ``limit`` in a parsed JSON ``value`` (nested included), as
    ``(its path, it)``; None when there is none. Booleans are not integers here.

    ``value`` is what :func:`parse_json` made of a bounded text, so the walk is bounded too.
    """
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, f"{path}.{str(k)[:40]}" if path else str(k)[:40]) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(node))))
        elif type(node) is int and abs(node) > limit:
            return path or "the value", node
    return None
