"""One way to write every number of a table column or a chart's series.

A column that mixes ``1.19898e-07`` with ``0.000256862`` reads as two kinds of number. The pages
pick one notation for the whole column from the values it holds and write every value in it:

- **integers** (every value a whole number) with thousands separators: ``12,000``;
- **fixed** point with the same number of decimals for every value, enough for each value's six
  significant digits: ``2.50``, ``0.05``, ``11.25``;
- **scientific** with the same number of mantissa decimals, when the values are very small or
  very large (below 1e-4 or from 1e6) or span more than six orders of magnitude, so fixed point
  would hide the small ones: ``1.19898e-07``, ``2.56862e-04``.

Zero is ``0`` in scientific notation (it has no exponent); NaN and infinities (a diverging run's
metrics) are ``NaN``, ``Infinity`` and ``-Infinity`` (as the JSON API writes them) and never
choose the notation. Nothing here knows HTML.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

#: Significant digits every value keeps.
DIGITS = 6
#: Below this magnitude (or from :data:`LARGE` on) a column is written in scientific notation.
SMALL, LARGE = 1e-4, 1e6
#: Integers at or past this magnitude are written in scientific notation (floats lose digits there).
MAX_INTEGER = 10**15

Kind = Literal["integer", "fixed", "scientific"]


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return _is_real(value) and math.isfinite(value)


def _exponent(value: float) -> int:
    """The decimal exponent of ``value`` once rounded to :data:`DIGITS` significant digits."""
    return int(f"{value:.{DIGITS - 1}e}".partition("e")[2])


def _mantissa_decimals(value: float) -> int:
    """Mantissa decimals ``value`` needs at :data:`DIGITS` significant digits (trailing zeros dropped)."""
    mantissa = f"{abs(value):.{DIGITS - 1}e}".partition("e")[0]
    return len(mantissa.rstrip("0").partition(".")[2])


def _fixed_decimals(value: float) -> int:
    """Decimals ``value`` needs in fixed point to keep :data:`DIGITS` significant digits (trailing zeros dropped)."""
    return max(0, _mantissa_decimals(value) - _exponent(value))


@dataclass(frozen=True)
class NumberFormat:
    """How every number of one column or series is written: the notation and its decimals."""

    kind: Kind = "integer"
    decimals: int = 0

    @classmethod
    def of(cls, values: Iterable[Any]) -> NumberFormat:
        """The format for a column holding ``values`` (anything that is not a finite number is ignored)."""
        numbers = [float(v) for v in values if _finite(v)]
        if all(v.is_integer() and abs(v) < MAX_INTEGER for v in numbers):  # also none, or only zeros
            return cls("integer", 0)
        nonzero = [abs(v) for v in numbers if v != 0]
        low, high = min(nonzero), max(nonzero)
        low_exp, high_exp = _exponent(low), _exponent(high)
        if low < SMALL or high >= LARGE or high_exp - low_exp >= DIGITS:
            return cls("scientific", max(_mantissa_decimals(v) for v in nonzero))
        return cls("fixed", max(_fixed_decimals(v) for v in nonzero))

    def __call__(self, value: Any) -> str:
        """``value`` in this format; '—' for None, 'NaN' / 'Infinity' / '-Infinity' for the non-finite."""
        if value is None or not _is_real(value):
            return "—"
        if not math.isfinite(value):
            return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")  # as the JSON API
        if self.kind == "integer":
            return f"{round(value):,}"
        if self.kind == "fixed":
            return f"{value:,.{self.decimals}f}"
        return "0" if value == 0 else f"{value:.{self.decimals}e}"

    def signed(self, value: float) -> str:
        """A difference in this format with its sign: '+0.05', '−1,000' (a real minus sign), '±0'."""
        text = self(abs(value)) if value else "0"
        return ("+" if value > 0 else "−" if value < 0 else "±") + text
