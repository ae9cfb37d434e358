"""A resumed job hashes only what changed: load teaches the client's digest cache the verified
digests of the frozen tensors it filled, so the next save skips them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ckptstore import client
from ckptstore.client.saving import saver as saving
from ckptstore.client.saving import upload as uploading
from tests.client.conftest import Backend
from tests.client.models import tensors_equal

FROZEN = 128  # 128 x 128 fp32 = 64 KiB: the smallest a cache entry may be


class Adapted(nn.Module):
    """A frozen base of cacheable size and a small trainable head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Sequential(nn.Linear(FROZEN, FROZEN), nn.Linear(FROZEN, FROZEN))
        self.base.requires_grad_(False)
        self.head = nn.Linear(FROZEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(x))


BASE_WEIGHTS = {"model/base.0.weight", "model/base.1.weight"}


def _train(model: Adapted, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(8, FROZEN, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def _hashed_by_next_save(monkeypatch: pytest.MonkeyPatch, ckpt: client.Client, model: Adapted, optim: Any) -> set[str]:
    """The keys whose bytes the next save of ``model`` hashes on the client (cache misses)."""
    return _next_save(monkeypatch, ckpt, model, optim)[0]


def _next_save(
    monkeypatch: pytest.MonkeyPatch, ckpt: client.Client, model: Adapted, optim: Any
) -> tuple[set[str], set[str]]:
    """The keys whose bytes the next save of ``model`` hashes on the client (cache misses), and
    those it hands to the store unhashed (changed in place since the store got them)."""
    hashed: list[str] = []
    unhashed: list[str] = []
    real = saving.digest_all
    real_add = uploading.ShardUploader.add_unhashed

    def spied(tensors: list[tuple[str, torch.Tensor]], cache: Any, **kwargs: Any) -> list[str]:
        known = kwargs.get("known") or [None] * len(tensors)
        hashed.extend(key for (key, _), digest in zip(tensors, known, strict=True) if digest is None)
        return real(tensors, cache, **kwargs)

    def spied_add(self: Any, index: int, key: str, tensor: torch.Tensor, nbytes: int, **kwargs: Any) -> None:
        unhashed.append(key)
        real_add(self, index, key, tensor, nbytes, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(saving, "digest_all", spied)
        patch.setattr(uploading.ShardUploader, "add_unhashed", spied_add)
        ckpt.save("resumed", model, optim)
    return set(hashed), set(unhashed)


@pytest.fixture
def resumed(backend: Backend) -> Iterator[client.Client]:
    """A second client on the backend's store, with an empty cache as a new process has, after
    the first client saved a trained model."""
    model = Adapted(seed=0)
    optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    _train(model, optim)
    backend.client.save("resumed", model, optim)
    transport: Any = backend.client.transport
    if backend.name == "embedded":
        fresh = client.Client(home=transport.staging_dir.parent)
    else:
        fresh = client.Client(transport.url)
    with fresh:
        yield fresh


def test_a_resumed_job_does_not_hash_the_frozen_base_again(
    resumed: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Adapted(seed=1)
    optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    resumed.load("resumed", model=model, optim=optim)
    _train(model, optim)
    hashed, unhashed = _next_save(monkeypatch, resumed, model, optim)
    assert not hashed & BASE_WEIGHTS, f"the frozen base was hashed again: {sorted(hashed & BASE_WEIGHTS)}"
    assert not unhashed & BASE_WEIGHTS, "the frozen base was written again"
    trained = {"model/head.weight", "optim/state/head.weight/exp_avg"}
    if resumed.transport.takes_unhashed:  # changed in place since the load: written, hashed as written
        assert trained <= unhashed and not trained & hashed
    else:
        assert trained <= hashed
    loaded = Adapted(seed=2)
    resumed.load("resumed", model=loaded)
    for name, tensor in model.state_dict().items():
        assert tensors_equal(loaded.state_dict()[name], tensor), name


def test_a_frozen_tensor_changed_after_load_is_hashed_and_stored_as_it_is_now(
    resumed: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Adapted(seed=1)
    optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    resumed.load("resumed", model=model, optim=optim)
    model.base[0].weight.data.mul_(2.0)  # through .data: the version counter does not move
    hashed = _hashed_by_next_save(monkeypatch, resumed, model, optim)
    assert "model/base.0.weight" in hashed and "model/base.1.weight" not in hashed
    loaded = Adapted(seed=2)
    resumed.load("resumed", model=loaded)
    assert tensors_equal(loaded.base[0].weight, model.base[0].weight)


def test_tensors_cast_on_load_are_not_known_by_their_stored_digest(
    resumed: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Adapted(seed=1)
    optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    resumed.load("resumed", model=model, optim=optim, dtype=torch.float64)
    hashed, unhashed = _next_save(monkeypatch, resumed, model, optim)
    # Their bytes are read again: hashed by the client, or (on an embedded store, which holds
    # no float64 tensor of their size) handed to the store, which hashes them as it writes.
    assert BASE_WEIGHTS <= hashed | unhashed


def test_a_load_onto_meta_teaches_the_cache_nothing_and_fails_nothing(resumed: client.Client) -> None:
    model = Adapted(seed=1).to("meta")
    resumed.load("resumed", model=model, device="meta")
    assert resumed.digest_cache is not None
    assert all(resumed.digest_cache.get(p) is None for p in model.parameters())


def test_a_resumed_job_asks_the_store_only_about_what_changed(
    resumed: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Adapted(seed=1)
    optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    loaded = resumed.load("resumed", model=model, optim=optim)
    stored = {e.key: e.digest for e in resumed.transport.manifest("resumed", loaded.version).tensors}
    _train(model, optim)
    asked: list[str] = []
    transport: Any = resumed.transport
    real = transport.missing

    def spied(digests: Any, **kwargs: Any) -> list[str]:
        asked.extend(digests)
        return real(digests, **kwargs)

    monkeypatch.setattr(transport, "missing", spied)
    resumed.save("resumed", model, optim)
    unchanged = {stored[key] for key in ("model/base.0.bias", "model/base.1.bias", *BASE_WEIGHTS)}
    assert not unchanged & set(asked)
    # What changed in place since the load goes to an embedded store unhashed: nothing to ask.
    assert bool(asked) != resumed.transport.takes_unhashed
