"""The Trainable share the pages show: the trainable model bytes over the model's own bytes
(every ``model/`` tensor: its parameters and buffers), never over the logical size, which counts
the optimizer's state and the extras too (a fully trainable MLP with AdamW showed 33%).

A version's record keeps its trainable bytes but not its model's, so the run page reads the
model's bytes from the manifests of the versions it shows, at most one page of them, each
remembered (a version never changes) in a bounded cache keyed by the store and the version's
commit time (a number deleted and used again is another key).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import datetime

from ckptstore.service.format.manifest import Manifest
from ckptstore.service.format.records import VersionInfo
from ckptstore.service.store import Store

#: Versions whose model bytes are remembered.
CACHE_ENTRIES = 8192
MODEL_PREFIX = "model/"

_cache: OrderedDict[tuple[str, str, int, datetime], int] = OrderedDict()
_lock = threading.Lock()


def manifest_model_bytes(manifest: Manifest) -> int:
    """The bytes of a manifest's model tensors (``model/``): the Trainable share's denominator."""
    return sum(entry.nbytes for entry in manifest.tensors if entry.key.startswith(MODEL_PREFIX))


def model_bytes(store: Store, info: VersionInfo) -> int:
    """The bytes of ``info``'s model tensors, read from its manifest once and then remembered."""
    key = (store.db.url, info.run_id, info.version, info.created_at)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    found = manifest_model_bytes(store.manifest(info.run_id, info.version))
    with _lock:
        _cache[key] = found
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return found


def trainable_share(trainable: int, model: int) -> float | None:
    """Trainable bytes over the model's bytes; None for a version with no model tensors."""
    return trainable / model if model else None


__all__ = ["CACHE_ENTRIES", "manifest_model_bytes", "model_bytes", "trainable_share"]
