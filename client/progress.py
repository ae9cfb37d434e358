"""Progress bars for long transfers: shown on a terminal, silent otherwise.

Set ``CKPTSTORE_DISABLE_PROGRESS_BARS=1`` to silence them on a terminal too.
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def bars_enabled() -> bool:
    """True when stderr is a terminal and bars are not disabled by environment variable."""
    if os.environ.get("CKPTSTORE_DISABLE_PROGRESS_BARS", "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    return sys.stderr.isatty()


def byte_bar(total: int, description: str) -> tqdm:
    """A bar counting bytes with throughput, disabled unless :func:`bars_enabled`."""
    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not bars_enabled(),
        leave=False,
    )
