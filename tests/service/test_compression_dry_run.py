"""``gc --compress --dry-run`` predicts what the real pass then does: every tensor is counted once,
however many runs and versions hold it, and the prediction encodes for real in memory, so its
figures are the real pass's exactly."""

from __future__ import annotations

import torch
from compression_kit import FineTune, large_digests

from ckptstore import client
from ckptstore.service.store import Store


def test_a_dry_run_counts_tensors_shared_by_runs_once_and_predicts_the_real_pass(
    store: Store, ckpt: client.Client
) -> None:
    tune = FineTune(torch.bfloat16)
    for _ in range(3):
        tune.save(ckpt, "first")  # trains a few steps, then saves
        ckpt.save("fork", tune.model, tune.optim)  # the same state in a second run: every tensor shared
    # A third run's version holds the first run's first state again, after a later one.
    first = tune.saved[("first", 1)]
    again = FineTune(torch.bfloat16)
    again.model.load_state_dict(first.model)
    ckpt.save("fork", again.model)
    large = {d for run in ("first", "fork") for v in (1, 2, 3) for d in large_digests(store, run, v).values()}
    distinct_bytes = sum(location.nbytes for location in store.locate(large).values())

    predicted = ckpt.gc(compress=True, grace_seconds=0, dry_run=True)
    done = ckpt.gc(compress=True, grace_seconds=0)

    assert predicted.dry_run and not done.dry_run
    assert predicted.bytes_before_compression == done.bytes_before_compression == distinct_bytes
    assert predicted.bytes_after_compression == done.bytes_after_compression
    assert predicted.bytes_after_compression < predicted.bytes_before_compression
    assert predicted.tensors_compressed == done.tensors_compressed == len(large)
    assert predicted.tensors_as_deltas == done.tensors_as_deltas
    assert predicted.versions_compressed == done.versions_compressed == 7
    assert tune.wrong_loads(ckpt, "first") == {}
