"""How the pages write numbers, sizes, times and JSON values for a reader (the template filters).

Everything shown rounded has its full value in a ``title`` next to it; these functions only make
text, the templates escape it.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from typing import Any

from markupsafe import Markup, escape

from ckptstore.service.api.pages.numbers import NumberFormat
from ckptstore.service.format.names import metric_to_json

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


_BREAK_AFTER = re.compile(r"([_/.:-])(?=.)")


def breakable(name: str) -> Markup:
    """``name`` escaped, with a line-break opportunity (``<wbr>``) after each ``_ / . : -``, so a
    long metric name in a column header wraps as ``tokens_`` / ``per_`` / ``second``."""
    return Markup(_BREAK_AFTER.sub(r"\1<wbr>", str(escape(name))))


def percent(share: float | None) -> str:
    """0.875 -> '87.5%'; None -> '—'."""
    return "—" if share is None else f"{share * 100:.1f}%"


def number(value: float | None) -> str:
    """A metric or step for a table cell: six significant digits, '—' when absent, and a NaN or
    infinite metric as the JSON API writes it ('NaN', 'Infinity', '-Infinity')."""
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(metric_to_json(value))  # a diverged run's loss reads as what it is
    return f"{value:,}" if isinstance(value, int) else f"{value:.{DIGITS}g}"


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


#: How the client writes what JSON has no word for (client/jsonstate.py): one-key marker objects.
_MARKERS = {"__tuple__", "__float__", "__dict__", "__dtype__", "__device__", "__tensor__"}
#: Names of values that count something: a change of one has no meaningful percentage.
COUNTERS = frozenset({"step", "steps", "epoch", "global_step", "last_epoch", "_step_count", "iteration", "iter"})


def _marker(value: Any) -> tuple[str, Any] | None:
    if isinstance(value, dict) and len(value) == 1:
        name, inner = next(iter(value.items()))
        if name in _MARKERS:
            return name, inner
    return None


def python_text(value: Any) -> str:
    """A stored JSON value as Python would write it, each number to six significant digits:
    ``{"__tuple__": [0.9, 0.999]}`` -> ``(0.9, 0.999)``, ``null`` -> ``None``, ``true`` -> ``True``."""
    marked = _marker(value)
    if marked is not None:
        name, inner = marked
        if name == "__tuple__" and isinstance(inner, list):
            items = [python_text(item) for item in inner]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if name == "__float__":
            return {"inf": "inf", "-inf": "-inf"}.get(str(inner), "NaN")
        if name == "__dict__" and isinstance(inner, list):
            pairs = [p for p in inner if isinstance(p, list) and len(p) == 2]
            return "{" + ", ".join(f"{python_text(k)}: {python_text(v)}" for k, v in pairs) + "}"
        if name == "__dtype__":
            return f"torch.{inner}"
        if name == "__device__":
            return f"torch.device({json.dumps(inner, ensure_ascii=False)})"
        return f"tensor {json.dumps(inner, ensure_ascii=False)}"
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float)):
        return number(value) if math.isfinite(value) else NumberFormat()(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_text(item) for item in value) + "]"
    if isinstance(value, dict):
        keys = sorted(str(key) for key in value)
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {python_text(value[k])}" for k in keys) + "}"
    return json.dumps(value, ensure_ascii=False)


def full_json(value: Any) -> str:
    """A JSON value exactly as stored ('—' for absent), for a ``title``."""
    return "—" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)


def reading_json(value: Any, fmt: NumberFormat | None = None) -> str:
    """A JSON value for reading ('—' for absent): a number in ``fmt`` (the format of its row),
    anything else as Python writes it (:func:`python_text`), tuples as tuples."""
    if value is None:
        return "—"
    if fmt is not None and is_number(value):
        return fmt(value)
    return python_text(value)


def signed(value: float) -> str:
    """A difference with its sign: '+0.05', '−1,000' (a real minus sign)."""
    text = number(abs(value)) if value else "0"
    return ("+" if value > 0 else "−" if value < 0 else "±") + text


def relative_means_something(path: str, before: float, after: float) -> bool:
    """Whether a percentage change says anything: not for whole-number types (counters, sizes),
    counters by name (step, epoch), a zero start or a change of sign."""
    if isinstance(before, int) or isinstance(after, int):
        return False
    if path.rsplit("/", 1)[-1].lower() in COUNTERS:
        return False
    return before != 0 and (before > 0) == (after > 0 or after == 0)


def delta(before: Any, after: Any, path: str = "", fmt: NumberFormat | None = None) -> tuple[str, str, str] | None:
    """(change, its full value, relative change) of two numbers in ``fmt`` (by default the format
    of the pair); None unless both are numbers.

    The relative change is over the magnitude of ``before``, and '—' where a percentage means
    nothing (:func:`relative_means_something`): a counter's change reads '+49', never '+490%'.
    """
    if not (is_number(before) and is_number(after)):
        return None
    fmt = fmt or NumberFormat.of([before, after])
    change = after - before
    relative = (
        f"{change / abs(before) * 100:+,.1f}%".replace("-", "−")
        if relative_means_something(path, before, after)
        else "—"
    )
    return fmt.signed(change), repr(change), relative
