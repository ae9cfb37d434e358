"""Pausing Python's cyclic garbage collector while a save or load builds many small objects.

A load of 32,768 small tensors creates a few hundred thousand short-lived objects (manifest
entries, locations, read plans). Each few thousand allocations start a collection, and the
oldest generation's collections walk every object the process holds (the model's modules and
parameters included), so collection took a third of such a load. None of these objects forms
a reference cycle that must be freed during the call: reference counting frees them.

The collector is off from the first entry to the last exit of :func:`paused_collection` (calls
may nest and overlap across threads) and is then switched back on only if it was on at the
first entry, so a program that runs with it off keeps it off.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextmanager
def paused_collection() -> Iterator[None]:
    """Keep the cyclic garbage collector off for the duration of the ``with`` block."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
