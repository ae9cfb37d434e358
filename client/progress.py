"""Progress bars for long transfers: shown on a terminal, silent otherwise.

Set ``CKPTSTORE_DISABLE_PROGRESS_BARS=1`` to silence them on a terminal too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from tqdm.auto import tqdm


def bars_enabled() -> bool:
    """True when stderr is a terminal and bars are not disabled by environment variable."""
    if os.environ.get("CKPTSTORE_DISABLE_PROGRESS_BARS", "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    return sys.stderr.isatty()


def byte_bar(total: int | Callable[[], int], description: str) -> tqdm:
    """A bar counting bytes with throughput, disabled unless :func:`bars_enabled`.

    ``total`` may be a function, called only if the bar is shown (summing the sizes of tens of
    thousands of tensors is not free).
    """
    enabled = bars_enabled()
    return tqdm(
        total=(total() if callable(total) else total) if enabled else 0,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled,
        leave=False,
    )


class BarCounter:
    """A bar's count as a compressing collection's ``on_bytes``: told the total before the first
    tensor (``expect``), so the bar shows how far it is and the time left."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def __call__(self, nbytes: int) -> None:
        """Count ``nbytes`` more."""
        self.bar.update(nbytes)

    def expect(self, total: int) -> None:
        """Set the bar's total."""
        self.bar.total = total
        self.bar.refresh()


def counter(bar: tqdm) -> BarCounter | None:
    """:class:`BarCounter` for a shown bar; None for a hidden one (nothing is counted for it)."""
    return None if bar.disable else BarCounter(bar)
