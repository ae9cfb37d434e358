"""Strict JSON parsing for request bodies: no duplicate keys, NaN, Infinity or deep nesting."""

from __future__ import annotations

import json
import json.scanner
import math
from typing import Any

from ckptstore.service.errors import InvalidInputError

MAX_DEPTH = 128


def strict_decoder(error: type[InvalidInputError], what: str, *, floats: bool = True) -> json.JSONDecoder:
    """A JSONDecoder that raises ``error`` on duplicate keys, NaN/Infinity and out-of-range floats.

    With ``floats=False`` every non-integer number is refused too (safetensors headers).
    """

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise error(f"{what} has the key {key[:80]!r} twice")
            result[key] = value
        return result

    def no_constant(name: str) -> Any:
        raise error(f"{what} contains {name}, which is not a JSON number")

    def finite_float(text: str) -> float:
        if not floats:
            raise error(f"{what} contains the number {text[:40]}; only integers are allowed")
        value = float(text)
        if not math.isfinite(value):
            raise error(f"{what} number {text[:40]} is out of range")
        return value

    return json.JSONDecoder(object_pairs_hook=no_duplicates, parse_constant=no_constant, parse_float=finite_float)


def _yielding_decoder() -> json.JSONDecoder:
    """The strict decoder for request bodies, scanning with Python code instead of C.

    The C scanner reads a whole array of strings, or an object of string values, without ever
    giving up the GIL, so even on a worker thread a large body would stall the server's event
    loop for as long as the scan takes. The Python scanner lets other threads run between
    tokens (strings are still decoded in C), and next to validation it costs little.
    """
    decoder = strict_decoder(InvalidInputError, "JSON body")
    decoder.memo = _NoMemo()  # type: ignore[attr-defined]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder


class _NoMemo(dict[str, str]):
    """A key memo that keeps nothing. The scanner shares one string per distinct key through
    its memo; with a million distinct keys the memo grew to a million entries, and growing and
    clearing it were single calls of 30 and 15 ms holding the GIL."""

    def setdefault(self, key: str, default: str | None = None) -> str:
        return key if default is None else default


_DECODER = _yielding_decoder()


def _depth(value: Any, limit: int) -> None:
    # Depth first with one iterator per open container: memory grows with the depth, not with
    # the number of values (a stack of every value waiting cost 60 bytes for each).
    stack = [iter((value,))]
    while stack:
        for item in stack[-1]:
            if isinstance(item, (dict, list)) and item:
                if len(stack) >= limit:
                    raise InvalidInputError(f"JSON nests deeper than {limit} levels")
                stack.append(iter(item.values() if isinstance(item, dict) else item))
                break
        else:
            stack.pop()


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
        value = _DECODER.decode(text)
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
