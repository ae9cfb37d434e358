"""JSON files of a checkpoint folder (configs, indexes, headers, trainer state), parsed strictly."""

from __future__ import annotations

import json
from typing import Any

from service.errors import InvalidInputError
from service.format.jsondoc import strict_decoder


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
