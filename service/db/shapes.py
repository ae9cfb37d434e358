"""Tensor shapes as the metadata database hands them back."""

from __future__ import annotations

import json
from typing import Any


class ShapeCache:
    """Stored shapes read as lists, each distinct JSON text parsed once.

    A model's tensors share a few shapes, so parsing every row's text anew was a good part of
    checking a manifest. PostgreSQL's driver hands JSON over already parsed.
    """

    def __init__(self) -> None:
        self._parsed: dict[str, list[int]] = {}

    def __call__(self, value: Any) -> list[int]:
        if not isinstance(value, str):
            return _sizes(value)
        parsed = self._parsed.get(value)
        if parsed is None:
            parsed = self._parsed[value] = _sizes(json.loads(value))
        return parsed


def _sizes(value: Any) -> list[int]:
    """``value`` as a shape: a list of sizes, else ValueError (a damaged row, never passed on)."""
    if not isinstance(value, list) or not all(type(size) is int and size >= 0 for size in value):
        raise ValueError(f"a stored shape is not a list of sizes: {str(value)[:40]!r}")
    return value
