"""Strict JSON parsing for request bodies: no duplicate keys, NaN, Infinity or deep nesting."""

from __future__ import annotations

import json
import math
from typing import Any

from service.errors import InvalidInputError

MAX_DEPTH = 128


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise InvalidInputError(f"JSON object has the key {key[:80]!r} twice")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise InvalidInputError(f"JSON contains {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidInputError(f"JSON number {text[:40]} is out of range")
    return value


def _depth(value: Any, limit: int) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise InvalidInputError(f"JSON nests deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def parse_json(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a JSON document strictly, raising InvalidInputError with the reason."""
    if isinstance(data, bytes):
        if data.startswith(b"\xef\xbb\xbf"):
            raise InvalidInputError("JSON body starts with a byte order mark")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"JSON body is not UTF-8 (byte {exc.start})") from exc
    else:
        text = data
    try:
        value = json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_float=_finite_float
        )
    except InvalidInputError:
        raise
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"body is not valid JSON: {exc.msg} at position {exc.pos}") from exc
    except RecursionError as exc:
        raise InvalidInputError(f"JSON nests deeper than {max_depth} levels") from exc
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise InvalidInputError(f"body is not acceptable JSON: {exc}") from exc
    _depth(value, max_depth)
    return value
