"""How the pages write numbers, sizes, times and JSON values for a reader (the template filters).

Everything shown rounded has its full value in a ``title`` next to it; these functions only make
text, the templates escape it.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Any

from markupsafe import Markup

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
#: Significant digits of a number shown rounded.
DIGITS = 6


def human_size(nbytes: int) -> str:
    """1536 -> '1.5 KiB' (binary units; bytes below 1 KiB as a whole number)."""
    if nbytes < 0:
        return "-" + human_size(-nbytes)
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def sized(nbytes: int) -> Markup:
    """A size for a page: '1.5 KiB', the exact count of bytes on hover (a filter, not a macro:
    the runs index writes three per run)."""
    count = int(nbytes)  # an int's digits and a size's units need no escaping
    return Markup(f'<span title="{count:,} bytes">{human_size(count)}</span>')


def percent(share: float | None) -> str:
    """0.875 -> '87.5%'; None -> '—'."""
    return "—" if share is None else f"{share * 100:.1f}%"


def number(value: float | None) -> str:
    """A metric or step for a table cell: six significant digits, '—' when absent."""
    if value is None:
        return "—"
    return f"{value:,}" if isinstance(value, int) else f"{value:.{DIGITS}g}"


def short(value: float) -> str:
    """A number for an axis label: four significant digits."""
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def when(moment: datetime) -> str:
    """A creation time as 'YYYY-MM-DD HH:MM:SS UTC'."""
    aware = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
    return aware.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def shape(dims: list[int]) -> str:
    """[4, 4] -> '4 × 4'; a scalar -> 'scalar'."""
    return " × ".join(str(d) for d in dims) if dims else "scalar"


def is_number(value: Any) -> bool:
    """True for an int or a finite float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rounded(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{DIGITS}g}")
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


def full_json(value: Any) -> str:
    """A JSON value exactly as stored ('—' for absent), for a ``title``."""
    return "—" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)


def reading_json(value: Any) -> str:
    """A JSON value for reading: numbers, also inside lists and objects, to six significant digits."""
    if value is None:
        return "—"
    if is_number(value):
        return number(value)
    return json.dumps(_rounded(value), sort_keys=True, ensure_ascii=False)


def signed(value: float) -> str:
    """A difference with its sign: '+0.05', '−1,000' (a real minus sign)."""
    text = number(abs(value)) if value else "0"
    return ("+" if value > 0 else "−" if value < 0 else "±") + text


def delta(before: Any, after: Any) -> tuple[str, str, str] | None:
    """(change, its full value, relative change) of two numbers; None unless both are numbers.

    The relative change is over the magnitude of ``before``: '—' when ``before`` is 0.
    """
    if not (is_number(before) and is_number(after)):
        return None
    change = after - before
    relative = "—" if before == 0 else f"{change / abs(before) * 100:+,.1f}%".replace("-", "−")
    return signed(change), repr(change), relative
