"""Tensors that changed in place since the client's last save go to an embedded store unhashed:
the store hashes them as it writes them. Same versions, same digests, every byte read once."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptstore import client
from ckptstore.client.saving import hashing
from ckptstore.client.saving import saver as saving
from ckptstore.client.saving.hashing import digest_of
from ckptstore.client.state import flatten
from ckptstore.service.errors import IntegrityError, StorageError
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.store import Store
from tests.client.conftest import Backend
from tests.client.models import TinyNet, train
from tests.faults.faulty import fail_staging_writes


class Spy:
    """Records what a save hashed on the client and what it handed to the store unhashed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hashed: list[str] = []
        self.unhashed: list[int] = []  # sizes of the tensors handed over, per call
        self.calls = 0
        digest_all, put_tensors = saving.digest_all, Store.put_tensors

        def spied_digest_all(tensors: list[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any) -> list[str]:
            self.hashed += [key for key, _ in tensors]
            return digest_all(tensors, *args, **kwargs)

        def spied_put(store: Store, tensors: list[UnhashedTensor], *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.unhashed += [t.data.nbytes for t in tensors]
            return put_tensors(store, tensors, *args, **kwargs)

        monkeypatch.setattr(saving, "digest_all", spied_digest_all)
        monkeypatch.setattr(Store, "put_tensors", spied_put)

    def reset(self) -> None:
        self.hashed, self.unhashed, self.calls = [], [], 0


def trained(steps: int = 1) -> tuple[TinyNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(steps))
    return model, optim


def assert_loads_exactly(ckpt: client.Client, run_id: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    fresh = TinyNet()
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.load(run_id, model=fresh, optim=fresh_optim)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    saved, loaded = optim.state_dict()["state"], fresh_optim.state_dict()["state"]
    for index, state in saved.items():
        for name, value in state.items():
            assert torch.equal(loaded[index][name], value), (index, name)


def manifest_digests(ckpt: client.Client, run_id: str) -> dict[str, str | None]:
    return {entry.key: entry.digest for entry in ckpt.transport.manifest(run_id, "latest").tensors}


def test_a_step_later_every_changed_tensor_is_stored_unhashed_and_loads_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optim = trained()
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path) as ckpt:
        first = ckpt.save("run", model, optim)
        assert spy.calls == 0 and len(spy.hashed) == first.tensors_total  # nothing known yet: all hashed first
        before = manifest_digests(ckpt, "run")
        spy.reset()
        train(model, optim, range(1, 2))
        second = ckpt.save("run", model, optim)
        # Weights, both moments and the step counts moved: handed over unhashed, as two shards (the
        # buffers saved with trainable False, BatchNorm's batch count, apart from the trainable
        # rest). Hashed as before: the tied embedding (one tensor under two keys) and BatchNorm's
        # running statistics, which its kernel changes without moving their version counters.
        hashed = ["model/bn.running_mean", "model/bn.running_var", "model/embed.weight", "model/head.weight"]
        assert sorted(spy.hashed) == hashed and spy.calls == 2
        assert len(spy.unhashed) == second.tensors_total - len(hashed)
        records = flatten(model, optim, None, None).records
        now = {r.key: digest_of(r.tensor, r.key) for r in records}
        new = {now[r.key]: r.tensor.numel() * r.tensor.element_size() for r in records if now[r.key] != before[r.key]}
        assert (second.tensors_new, second.bytes_new) == (len(new), sum(new.values()))
        assert_loads_exactly(ckpt, "run", model, optim)
        assert manifest_digests(ckpt, "run") == now
        spy.reset()
        third = ckpt.save("run", model, optim)  # nothing moved since
        assert spy.calls == 0 and third.bytes_stored == 0


def test_a_new_client_hashes_first_and_stores_nothing_the_store_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optim = trained()
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model, optim)
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path) as resumed:
        again = resumed.save("run", model, optim)
    assert spy.calls == 0 and (again.tensors_new, again.bytes_stored) == (0, 0)


def test_a_tensor_changed_back_to_a_stored_value_keeps_every_version_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optim = trained()
    weight = model.body[0].weight
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model, optim)
        before = manifest_digests(ckpt, "run")
        with torch.no_grad():
            weight.mul_(2.0)
        ckpt.save("run", model, optim)
        spy = Spy(monkeypatch)
        with torch.no_grad():
            weight.div_(2.0)  # back to the bytes of version 1
        third = ckpt.save("run", model, optim)
        assert spy.calls == 1 and spy.hashed == [k for k in before if k != "model/body.0.weight"]
        assert manifest_digests(ckpt, "run") == before
        # Its bytes were sent again (the save could not know), but the store keeps the first copy:
        # the save added nothing, as its version's record says.
        assert third.bytes_sent == weight.numel() * 4
        assert third.bytes_new == ckpt.versions("run")[-1].bytes_new == 0
        for version in (1, 3):
            fresh = TinyNet()
            ckpt.load("run", version, model=fresh)
            assert torch.equal(fresh.body[0].weight, weight)


def test_tensors_changed_in_place_to_equal_values_are_written_once(tmp_path: Path) -> None:
    model = nn.Module()
    model.register_buffer("a", torch.rand(256, 256))
    model.register_buffer("b", torch.rand(256, 256))
    model.register_buffer("c", torch.rand(256, 256))
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model)
        model.a.fill_(0.5)
        model.b.fill_(0.5)
        model.c.add_(1.0)
        second = ckpt.save("run", model)
        assert (second.tensors_new, second.bytes_new) == (2, 2 * 256 * 256 * 4)
        assert second.bytes_stored < 3 * 256 * 256 * 4
        target = nn.Module()
        for name in "abc":
            target.register_buffer(name, torch.zeros(256, 256))
        ckpt.load("run", model=target)
        for name in "abc":
            assert torch.equal(getattr(target, name), getattr(model, name)), name


def test_a_tied_weight_is_hashed_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))
    model[2].weight = model[0].weight
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("tied", model)
        spy = Spy(monkeypatch)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ckpt.save("tied", model)
        assert spy.calls == 0 and sorted(spy.hashed) == ["model/0.weight", "model/2.weight"]
        target = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))
        ckpt.load("tied", model=target)
        assert torch.equal(target[0].weight, model[0].weight) and torch.equal(target[2].weight, model[0].weight)


def test_a_full_disk_during_an_unhashed_write_stores_no_partial_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 16))  # 8 MiB: several staging buffers
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("full-disk", model)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.5)
        partial = fail_staging_writes(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        with pytest.raises(StorageError, match="No space left on device"):
            ckpt.save("full-disk", model)
        assert len(partial) == 1
        assert [v.version for v in ckpt.versions("full-disk")] == [1]
        assert list(ckpt.transport.staging_dir.glob("*")) == []  # type: ignore[attr-defined]
        saved = ckpt.save("full-disk", model)  # still taken for changed: written unhashed again
        assert saved.version == 2 and saved.tensors_new == 4
        target = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 16))
        ckpt.load("full-disk", model=target)
        for name, tensor in model.state_dict().items():
            assert torch.equal(target.state_dict()[name], tensor), name


def test_every_backend_gives_the_same_digests_for_a_trained_step(backend: Backend) -> None:
    model, optim = trained()
    backend.client.save("run", model, optim)
    train(model, optim, range(1, 3))
    backend.client.save("run", model, optim)
    records = flatten(model, optim, None, None).records
    assert manifest_digests(backend.client, "run") == {r.key: digest_of(r.tensor, r.key) for r in records}
    assert_loads_exactly(backend.client, "run", model, optim)


def test_weights_another_client_deleted_and_swept_are_sent_again(tmp_path: Path) -> None:
    # A save does not ask about the digests its client's last version references; when another
    # process deleted that version and swept its tensors, the commit says so and the save sends them.
    torch.manual_seed(0)
    model = TinyNet().requires_grad_(False)
    with client.Client(home=tmp_path) as ckpt, client.Client(home=tmp_path) as other:
        first = ckpt.save("run", model)
        other.delete("run", first.version)
        other.gc(grace_seconds=0)
        assert other.transport.missing(list(manifest_digests_of(model).values())) != []
        again = ckpt.save("run", model)
        assert (again.version, again.bytes_new) == (2, first.bytes_new)
        fresh = TinyNet()
        ckpt.load("run", model=fresh)
        for name, tensor in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), name


def manifest_digests_of(model: nn.Module) -> dict[str, str]:
    return {r.key: digest_of(r.tensor, r.key) for r in flatten(model, None, None, None).records}


def test_a_frozen_tensor_changed_while_it_was_hashed_is_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cache keeps a tensor's fingerprint from before its bytes were read: a change during
    # hashing leaves the entry stale, so the next save hashes the tensor anew.
    torch.manual_seed(0)
    model = TinyNet().requires_grad_(False)
    weight = model.body[0].weight
    real_digest_of = hashing.digest_of
    changed: list[bool] = []

    def digest_then_change(tensor: torch.Tensor, key: str) -> str:
        digest = real_digest_of(tensor, key)
        if tensor is weight and not changed:
            changed.append(True)
            with torch.no_grad():
                weight.add_(1.0)  # another thread steps the tensor right after it was hashed
        return digest

    monkeypatch.setattr(hashing, "digest_of", digest_then_change)
    with client.Client(home=tmp_path) as ckpt:
        with pytest.raises(IntegrityError, match="changed"):
            ckpt.save("run", model)
        assert ckpt.runs() == []
        ckpt.save("run", model)
        fresh = TinyNet()
        ckpt.load("run", model=fresh)
        assert torch.equal(fresh.body[0].weight, weight)
