"""When ``background="auto"`` moves a client's background saves from its thread to a save process.

A background save on the client's thread holds the training process's interpreter for the Python
it runs (hashing bookkeeping, the manifest, the commit: 10-30 ms a LoRA save), and a loop that
launches its work from Python pays for all of it (:mod:`client.saving.save_process`). Now and then
that costs nothing worth a second process; after every step it was two thirds of a step on a GPU
node. A save process takes that Python off the loop, but it is a second Python process holding
torch (a few hundred MiB, a few seconds to start), so ``auto`` starts one only for a loop that
saves often: at the :data:`RUN_LENGTH`-th background save in a row that comes within
:data:`CLOSE_SECONDS` of the one before it. The thresholds are read at each call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Literal

from ckptstore.service.errors import InvalidInputError

#: Background saves this close together (seconds, from call to call) are a loop saving often.
CLOSE_SECONDS = 10.0
#: How many such saves in a row start a save process (the first one counts).
RUN_LENGTH = 4
#: Where a client's ``background`` comes from when it is not given.
VARIABLE = "CKPTSTORE_BACKGROUND"

Background = Literal["auto", "thread", "process"]
MODES: tuple[Background, ...] = ("auto", "thread", "process")


def background_mode(given: str | None) -> Background:
    """The background mode of a client: ``given``, else ``$CKPTSTORE_BACKGROUND``, else ``"auto"``.

    Raises:
        InvalidInputError: a mode other than ``auto``, ``thread`` or ``process`` (naming where it came from).
    """
    if given is not None:
        where, value = "background", given
    else:
        where, value = f"${VARIABLE}", os.environ.get(VARIABLE, "").strip().lower() or "auto"
    for mode in MODES:
        if value == mode:
            return mode
    raise InvalidInputError(f"{where} must be 'auto', 'thread' or 'process', not {str(value)[:40]!r}")


class SaveCadence:
    """The times of one client's background saves, as far as ``auto`` needs them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: float | None = None
        self._run = 0

    def often(self) -> bool:
        """Note a background save starting now; whether the saves now come often enough for a
        save process (:data:`RUN_LENGTH` in a row, each within :data:`CLOSE_SECONDS` of the last)."""
        now = self._clock()
        close = self._last is not None and now - self._last <= CLOSE_SECONDS
        self._run = self._run + 1 if close else 1
        self._last = now
        return self._run >= RUN_LENGTH
