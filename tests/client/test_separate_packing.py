"""Frozen tensors are packed apart from trainable ones, so racing first saves of a shared frozen base
store it once, and garbage collection reclaims each run's trainable shards with its versions."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ckptstore import client
from ckptstore.service.store import Store

BASE = 256  # a 256 x 256 fp32 frozen base: 256 KiB, far above any adapter


class Adapted(torch.nn.Module):
    """A frozen base shared by every run and a small trainable adapter of the run's own."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(BASE, BASE)
        self.base.requires_grad_(False)
        torch.manual_seed(seed)
        self.adapter = torch.nn.Linear(BASE, 4)


class Racing:
    """A transport whose first ``missing`` answer waits until every racer has its own: each of
    them is told the base is missing, as when first saves of a shared base start at once."""

    def __init__(self, transport: Any, barrier: threading.Barrier) -> None:
        self._transport = transport
        self._barrier = barrier
        self._asked = False

    def missing(self, digests: Iterable[str], **kwargs: Any) -> list[str]:
        answer = self._transport.missing(digests, **kwargs)
        if not self._asked:
            self._asked = True
            self._barrier.wait(timeout=60)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def blob_bytes(store: Store) -> dict[str, int]:
    sizes = {blob: store.blobs.size(blob) for blob in store.blobs.list_ids()}
    return {blob: size for blob, size in sizes.items() if size is not None}


def keys_of_shard(store: Store, shard_id: str) -> set[str]:
    path = store.blobs._path(shard_id)  # type: ignore[attr-defined]
    with safe_open(str(path), "pt") as shard:
        return set(shard.keys())


def test_racing_first_saves_store_the_frozen_base_once_and_gc_reclaims_the_rest(tmp_path: Path) -> None:
    home = tmp_path / "home"
    models = {"run-a": Adapted(1), "run-b": Adapted(2)}
    barrier = threading.Barrier(len(models))
    clients = {run: client.Client(home=home, hash_cache=False) for run in models}
    errors: list[BaseException] = []

    def save(run: str) -> None:
        try:
            ckpt = clients[run]
            ckpt.transport = Racing(ckpt.transport, barrier)  # type: ignore[assignment]
            ckpt.save(run, models[run])
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(run,)) for run in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    base_bytes = (BASE * BASE + BASE) * 4
    with client.Client(home=home) as ckpt:
        store = ckpt.transport
        assert isinstance(store, Store)
        manifests = {run: store.manifest(run) for run in models}
        base_digests = {e.digest for e in manifests["run-a"].tensors if e.key.startswith("model/base.")}
        assert base_digests == {e.digest for e in manifests["run-b"].tensors if e.key.startswith("model/base.")}
        # Both saves sent the base, as one and the same shard: its bytes are stored once.
        stored = blob_bytes(store)
        assert base_bytes < sum(stored.values()) < 2 * base_bytes
        base_shards = {store.locate(sorted(base_digests))[d].shard_id for d in base_digests}
        # The weight (of a size the empty store held none of) went unhashed, the small bias was
        # hashed first: at most one shard each way, shared by both runs.
        assert 1 <= len(base_shards) <= 2
        # No shard mixes the frozen base with an adapter.
        for shard in stored:
            held = keys_of_shard(store, shard)
            assert held <= base_digests or not (held & base_digests)
        # Run b gone, collection reclaims its adapter and keeps exactly the base and run a.
        ckpt.delete("run-b", 1)
        ckpt.gc(grace_seconds=0)
        left = blob_bytes(store)
        adapter_a = {e.digest for e in manifests["run-a"].tensors if e.key.startswith("model/adapter.")}
        assert set(left) == base_shards | {store.locate(sorted(adapter_a))[d].shard_id for d in adapter_a}
        # Then run a gone too: nothing is left alive by a neighbour in its shard.
        ckpt.delete("run-a", 1)
        ckpt.gc(grace_seconds=0)
        assert blob_bytes(store) == {}
    for ckpt in clients.values():
        ckpt.transport = ckpt.transport._transport  # type: ignore[attr-defined]
        ckpt.close()
