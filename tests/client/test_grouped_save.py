"""A save hashed in groups while earlier groups are sent: same versions, each tensor sent once,
bad manifests refused before any byte is stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptstore.client import Client
from ckptstore.client.saving.saver import SaveRun, SaveSettings
from ckptstore.client.state import flatten
from tests.client.conftest import Backend
from tests.client.shard_files import stored_digests

SHARD = 64 << 10  # small shards: the 1 MiB model below is hashed in many groups


class Wide(nn.Module):
    """Sixteen 64 KiB weights, a first and last layer tied, and two equal all-zero buffers far apart."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128, bias=False) for _ in range(16))
        self.layers[-1].weight = self.layers[0].weight
        self.register_buffer("zeros_a", torch.zeros(128, 128))
        self.register_buffer("zeros_b", torch.zeros(128, 128))


def test_a_grouped_save_sends_each_distinct_tensor_once_and_loads_exactly(backend: Backend) -> None:
    torch.manual_seed(0)
    model = Wide()
    backend.client.shard_bytes = SHARD
    result = backend.client.save("grouped", model)
    assert result.tensors_total == len(model.state_dict()) == 18
    # 15 distinct weights + one zero buffer: the tied weight and the second zero buffer are not sent again.
    assert result.tensors_new == 16
    assert result.bytes_new == 16 * 128 * 128 * 4
    assert result.shards > 4
    digests = stored_digests(backend.blobs)
    assert len(digests) == len(set(digests)) == 16
    fresh = Wide()
    backend.client.load("grouped", model=fresh)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    again = backend.client.save("grouped", model)
    assert (again.tensors_new, again.bytes_stored) == (0, 0)


def test_a_grouped_save_with_a_bad_metric_stores_nothing(backend: Backend) -> None:
    backend.client.shard_bytes = SHARD
    with pytest.raises(Exception, match="metric|loss") as raised:
        backend.client.save("bad", Wide(), metrics={"loss": "low"})  # type: ignore[dict-item]
    assert not isinstance(raised.value, AssertionError)
    assert list(backend.blobs.list_ids()) == []


def _hash_groups(ckpt: Client, model: torch.nn.Module) -> list[list[int]]:
    """The groups a save of ``model`` by ``ckpt`` would hash, from its real plan."""
    settings = SaveSettings(ckpt.transport, ckpt.shard_bytes, 2, ckpt.digest_cache, ckpt.ledger)
    plan, _ = SaveRun(settings, "r", flatten(model), step=None, metrics=None, tags=(), started=0.0).plan()
    return plan.groups


def test_groups_follow_the_bytes_still_to_hash(tmp_path: Path) -> None:
    model = Wide()
    with Client(home=tmp_path, shard_bytes=SHARD) as ckpt:
        # A store holding tensors of these sizes: each tensor might be stored, so it is hashed
        # first (into an empty store it would go unhashed, see test_unseen_sizes.py).
        ckpt.save("other", Wide())
        groups = _hash_groups(ckpt, model)
        assert len(groups) >= 8
        assert [i for group in groups for i in group] == list(range(len(flatten(model).records)))
        model.requires_grad_(False)
        ckpt.save("frozen", model)  # every tensor is now in the digest cache
        assert len(_hash_groups(ckpt, model)) == 1


def test_cached_tensors_the_store_lost_are_sent_again_in_their_group(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Frozen weights the client hashed before are asked about apart from the others; after
    # their only version is deleted and collected, the next save must send them again, in
    # whichever group they fall.
    torch.manual_seed(0)
    model = Wide()
    for index, layer in enumerate(model.layers):
        for param in layer.parameters():
            param.requires_grad_(index % 2 == 1)  # even layers frozen (and cached), odd ones trainable
    backend.client.shard_bytes = SHARD
    first = backend.client.save("lost", model)
    backend.client.delete("lost", first.version)
    backend.client.gc(grace_seconds=0)
    assert list(backend.blobs.list_ids()) == []
    with torch.no_grad():
        model.layers[1].weight.add_(1.0)
    transport = backend.client.transport
    commits: list[object] = []
    commit = transport.commit

    def counted(*args: Any, **kwargs: Any) -> Any:
        commits.append(args)
        return commit(*args, **kwargs)

    monkeypatch.setattr(transport, "commit", counted)
    again = backend.client.save("lost", model)
    assert len(commits) == 1  # sent before the commit, not after it was refused
    assert (again.tensors_new, again.bytes_new) == (first.tensors_new, first.bytes_new)
    digests = stored_digests(backend.blobs)
    assert len(digests) == len(set(digests)) == 16
    fresh = Wide()
    backend.client.load("lost", model=fresh)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
